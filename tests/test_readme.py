"""The README's library example runs as written, and its commands name real things."""

import os
import re

from ls_jax.configs import CONFIGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()


def test_library_example_runs():
    block = re.findall(r"```python\n(.*?)```", README, re.S)[0]
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["y_BxTxM"].shape == (2, 1024, 192)
    assert namespace["max_abs_logit_H"].shape == (6,)
    assert namespace["logits_BxTxV"].shape == (2, 512, 256)
    assert namespace["stats"]["attn_max_abs_logit"].shape == (2, 4)


def test_linen_and_attention_fn_example_runs():
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if "make_attention_fn" in b]
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    for name in ("y_BxTxM", "y_nnx", "y_linen"):
        assert namespace[name].shape == (2, 64, 128), name


def test_configs_named_in_readme_exist():
    for name in set(re.findall(r"--config (\w+)", README)):
        assert name in CONFIGS, name
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    for target in set(re.findall(r"^make (\w+)", README, re.M)):
        assert re.search(rf"^{target}:", makefile, re.M), target


def _block(marker: str) -> str:
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if marker in b]
    return block


def test_export_example_runs():
    namespace: dict = {}
    exec(compile(_block("from ls_jax.export import export"), "README.md", "exec"), namespace)
    assert namespace["exported_tpu"].platforms == ("tpu",)
    assert namespace["exported_gpu"].platforms == ("cuda",)
