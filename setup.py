"Package metadata comes from settings.ini (nbdev 2 layout)."
from configparser import ConfigParser
import setuptools, shlex

config = ConfigParser(delimiters=['='])
config.read('settings.ini', encoding='utf-8')
cfg = config['DEFAULT']

requirements = shlex.split(cfg.get('requirements', ''))
dev_requirements = shlex.split(cfg.get('dev_requirements', ''))
scripts = [s.strip() for s in cfg.get('console_scripts', '').split('\n') if s.strip()]

setuptools.setup(
    name=cfg['lib_name'], version=cfg['version'], description=cfg['description'],
    author=cfg['author'], author_email=cfg['author_email'], license='Apache-2.0',
    packages=setuptools.find_namespace_packages(include=['eagle3nb', 'eagle3nb.*']),
    include_package_data=True, package_data={'eagle3nb.templates': ['*'], 'eagle3nb.data': ['*']},
    install_requires=requirements, extras_require={'dev': dev_requirements},
    python_requires='>=' + cfg['min_python'], zip_safe=False,
    entry_points={'console_scripts': scripts, 'nbdev': [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"]},
)
