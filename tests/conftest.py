"Shared pytest fixtures: the kimi-tiny toy target, and one `transformers serve` on it for the whole session"

import os
import pytest

os.environ.setdefault('HF_HUB_OFFLINE', '1')  # tests never touch the Hub
os.environ.setdefault('OMP_NUM_THREADS', '1')  # the server and the test process share few cores
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')


@pytest.fixture(scope='session')
def kimi_tiny(tmp_path_factory):
    "Path of a freshly built kimi-tiny toy target (random DeepseekV3 + Kimi-K2 tokenizer and chat template)"
    from eagle3nb.toy import ensure_toy

    return ensure_toy('kimi-tiny', out=tmp_path_factory.mktemp('toy') / 'kimi-tiny')


@pytest.fixture(scope='session')
def toy_server(kimi_tiny, tmp_path_factory):
    "A running `LocalServer` on kimi-tiny (loopback, free port), stopped when the session ends"
    from eagle3nb.server import LocalServer

    with LocalServer(kimi_tiny, log_path=tmp_path_factory.mktemp('serve') / 'server.log') as srv:
        yield srv


# The files that each make a whole `eagle3nb run` (minutes each) go first, in this order: under `make test`'s two
# pytest-xdist workers (--dist loadfile --no-loadscopereorder) each worker starts with two of them, about 20 minutes
# apiece, and the short files fill in behind them. In one process (`pytest tests/`) they simply run first.
WHOLE_RUNS = ['test_demo_kimi.py', 'test_demo_sglang.py', 'test_demo.py', 'test_fleet.py']


def pytest_collection_modifyitems(session, config, items):
    first = {name: i for i, name in enumerate(WHOLE_RUNS)}
    items.sort(key=lambda item: first.get(item.path.name, len(WHOLE_RUNS)))  # stable: the rest keep their order
