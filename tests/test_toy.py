"Integration checks of `eagle3nb.toy` that need fresh processes or long inputs (the notebook covers the rest)."

import hashlib, json, os, subprocess, sys
from pathlib import Path

import pytest, torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3nb.toy import TOYS, BASE_TOYS, SAMPLE_TOOLS, build_toy, ensure_toy, sample_chat, special_tokens, toy_corpus

ENV = {**os.environ, 'OMP_NUM_THREADS': '1', 'HF_HUB_OFFLINE': '1', 'TOKENIZERS_PARALLELISM': 'false'}


def digest(d):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(Path(d).iterdir())}


def build_in_subprocess(name, out):
    "Build in a fresh interpreter, as `eagle3nb toy build` would"
    code = f"from eagle3nb.toy import build_toy; print(build_toy({name!r}, {str(out)!r}))"
    return subprocess.run([sys.executable, '-c', code], env=ENV, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize('name', [*BASE_TOYS, 'kimi-k25-tiny'])
def test_same_bytes_across_processes(tmp_path, name):
    "Two fresh processes (different hash seeds) build byte-identical directories"
    for d in ('a', 'b'):
        r = build_in_subprocess(name, tmp_path / d)
        assert r.returncode == 0, r.stderr
    assert digest(tmp_path / 'a') == digest(tmp_path / 'b')


RACER = """
import os, sys, time
from eagle3nb.toy import build_toy
print('ready', flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.005)
print(build_toy('qwen3-tiny', sys.argv[2]))
"""


def test_concurrent_builds_agree(tmp_path):
    "Two processes racing to build the same directory both succeed and leave one complete build"
    go, out = tmp_path / 'go', tmp_path / 'q'
    ps = [
        subprocess.Popen([sys.executable, '-c', RACER, str(go), str(out)], env=ENV, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    assert [p.stdout.readline().strip() for p in ps] == ['ready', 'ready']  # both imported: the start is the same
    go.write_text('')
    rs = [p.communicate(timeout=120) for p in ps]
    assert [p.returncode for p in ps] == [0, 0], rs
    go.unlink()
    assert json.loads((tmp_path / 'q' / 'eagle3nb_toy.json').read_text())['name'] == 'qwen3-tiny'
    assert [p.name for p in tmp_path.iterdir()] == ['q']  # no temp or old folders left


@pytest.mark.parametrize('name', BASE_TOYS)
def test_loads_renders_and_generates(tmp_path, name):
    "The directory loads with the Auto classes, renders the sample chat and generates"
    d = ensure_toy(name, tmp_path / name)
    tok, m = AutoTokenizer.from_pretrained(d), AutoModelForCausalLM.from_pretrained(d)
    kw = {TOYS[name].thinking_kwarg: True}
    text = tok.apply_chat_template(
        sample_chat(name), tools=SAMPLE_TOOLS, tokenize=False, add_generation_prompt=True, **kw
    )
    ids = tok.encode(text, add_special_tokens=False)
    for t, i in special_tokens(name).items():
        assert ids.count(i) == text.count(t), t
    x = tok.apply_chat_template(
        sample_chat(name), tools=SAMPLE_TOOLS, add_generation_prompt=True, return_tensors='pt', **kw
    )
    y = m.generate(**x, max_new_tokens=8, do_sample=False)
    assert y.shape[1] <= x['input_ids'].shape[1] + 8
    y2 = m.generate(**x, max_new_tokens=8, do_sample=False)
    assert torch.equal(y, y2)  # greedy is deterministic


@pytest.mark.parametrize('name', BASE_TOYS)
def test_10k_context_forward(tmp_path, name):
    "A 10K-token forward pass (the project's context length) gives finite logits and all hidden states"
    d = ensure_toy(name, tmp_path / name)
    m = AutoModelForCausalLM.from_pretrained(d)
    x = torch.randint(0, TOYS[name].n_bpe, (1, 10_240), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        o = m(x, output_hidden_states=True, logits_to_keep=16)
    assert len(o.hidden_states) == m.config.num_hidden_layers + 1
    assert o.hidden_states[-1].shape == (1, 10_240, m.config.hidden_size)
    assert torch.isfinite(o.logits).all()


def test_cli_shaped_errors(tmp_path):
    "Errors name the path and the way out"
    (tmp_path / 'mine').mkdir()
    (tmp_path / 'mine' / 'x').write_text('x')
    with pytest.raises(FileExistsError, match='choose another --out'):
        build_toy('kimi-tiny', tmp_path / 'mine')
    with pytest.raises(ValueError, match='known toys: kimi-tiny, qwen3-tiny, .*kimi-k25-tiny, kimi-k25-tiny-trained'):
        build_toy('gpt-tiny', tmp_path / 'g')


def test_toy_list():
    "Every toy a recipe may name, in the order `eagle3nb toy list` prints them"
    assert list(TOYS) == [
        'kimi-tiny',
        'qwen3-tiny',
        'kimi-tiny-trained',
        'qwen3-tiny-trained',
        'kimi-k25-tiny',
        'kimi-k25-tiny-trained',
    ]
    assert BASE_TOYS == ('kimi-tiny', 'qwen3-tiny')


K25_LOAD = """
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
d = sys.argv[1]
tok = AutoTokenizer.from_pretrained(d, trust_remote_code=True)
m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)
print(json.dumps([type(tok).__name__, type(m).__name__, tok.encode(open(sys.argv[2], encoding='utf-8', newline='').read())]))
"""


def test_k25_loads_as_remote_code_in_a_fresh_process(tmp_path):
    "A fresh interpreter loads kimi-k25-tiny's tokenizer and model through their remote code, kimi-tiny's ids"
    from eagle3nb.toy import CORPUS

    d = ensure_toy('kimi-k25-tiny', tmp_path / 'k25')
    env = {**ENV, 'HF_MODULES_CACHE': str(tmp_path / 'modules')}  # a cold remote-code cache
    r = subprocess.run(
        [sys.executable, '-c', K25_LOAD, str(d), str(CORPUS)], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    cls, model, ids = json.loads(r.stdout.strip().splitlines()[-1])
    assert (cls, model) == ('TikTokenTokenizer', 'Kimi_K25ForConditionalGeneration')
    kt = AutoTokenizer.from_pretrained(ensure_toy('kimi-tiny', tmp_path / 'kt'))
    assert ids == kt.encode(toy_corpus())
    assert sorted((tmp_path / 'modules').rglob('tokenization_kimi.py'))  # loaded from the folder, as remote code
