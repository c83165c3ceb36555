"""The README and the docs pages run as written: their Python examples run, their commands parse
with the real command lines (configs, flags and override keys exist), their links and anchors
resolve, and the pages stay short references (no dates, no "today", no "at <commit>")."""

import glob
import os
import re
import shlex

import pytest

from ls_jax.configs import CONFIGS, get_config
from ls_jax.configs.cli import eval_parser, train_parser
from ls_jax.inference.sample import build_parser as sample_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# docs/stability.md is written from its experiments' results, with its own commands
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
                               if not p.endswith("stability.md"))
MAX_LINES = {"README.md": 250}  # every other page: 300
# Python examples that need what a CPU test has not got: (page, a line of the example, why)
NOT_RUN = [
    ("docs/data.md", "mngr.save(step", "a fragment inside an orbax checkpoint manager"),
    ("docs/generation.md", "from ls_jax.inference.generate import generate",
     "needs a trained model and prompts"),
    ("docs/usage.md", "jax.make_mesh((2, 2)", "needs 4 devices: tests/partition_cases.py runs it"),
    ("docs/usage.md", "load_model(\"runs/tiny\")", "needs a trained run"),
    ("docs/library.md", "save_params(model", "needs the user's model: tests/test_library_use.py "
     "makes the same calls"),
]


def read(page: str) -> str:
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", read(page), re.S)


def block(page: str, marker: str) -> str:
    (found,) = [b for b in python_blocks(page) if marker in b]
    return found


def run_block(page: str, marker: str) -> dict:
    namespace: dict = {}
    exec(compile(block(page, marker), page, "exec"), namespace)
    return namespace


def shell_commands(page: str) -> list[str]:
    """The commands of the page's ```bash blocks, continuation lines joined, comments dropped."""
    commands = []
    for text in re.findall(r"```bash\n(.*?)```", read(page), re.S):
        for line in text.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def test_pages_are_listed():
    assert "README.md" in PAGES and "docs/training.md" in PAGES and "docs/README.md" in PAGES


@pytest.mark.parametrize("page", PAGES)
def test_page_stays_short(page):
    assert len(read(page).splitlines()) <= MAX_LINES.get(page, 300)


@pytest.mark.parametrize("page", PAGES)
def test_page_states_the_present(page):
    text = read(page)
    for name, pattern in [("a date", r"\b20\d\d-\d\d-\d\d\b"), ("today", r"\btoday\b"),
                          ("at <commit>", r"\bat [0-9a-f]{7,40}\b"),
                          ("before/after", r"\bbefore/after\b")]:
        found = re.search(pattern, text, re.I)
        assert not found, f"{page}: {name}: {found.group(0)!r}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page):
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", read(page)):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path = os.path.normpath(os.path.join(os.path.dirname(page), target)) if target else page
        assert os.path.exists(os.path.join(ROOT, path)), f"{page}: no {path}"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", read(path), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{page}: no #{anchor} in {path}"


@pytest.mark.parametrize("page,index", [
    pytest.param(page, i, id=f"{page}:{i}")
    for page in PAGES for i in range(len(python_blocks(page)))])
def test_python_example_runs(page, index):
    code = python_blocks(page)[index]
    for skip_page, skip_marker, why in NOT_RUN:
        if page == skip_page and skip_marker in code:
            pytest.skip(why)
    exec(compile(code, page, "exec"), {})


def test_readme_example_gives_the_shapes_it_names():
    ns = run_block("README.md", "from ls_jax import LSAttention")
    assert ns["y_BxTxM"].shape == (2, 1024, 192) and ns["max_abs_logit_H"].shape == (6,)
    assert ns["out"].shape == (2, 1024, 4, 64)


def test_usage_examples_give_the_shapes_they_name():
    ns = run_block("docs/usage.md", "from ls_jax import LSAttention, Transformer")
    assert ns["y_BxTxM"].shape == (2, 1024, 192) and ns["max_abs_logit_H"].shape == (6,)
    assert ns["logits_BxTxV"].shape == (2, 512, 256)
    assert ns["stats"]["attn_max_abs_logit"].shape == (2, 4)
    ns = run_block("docs/usage.md", "make_attention_fn")
    for name in ("y_BxTxM", "y_nnx", "y_linen"):
        assert ns[name].shape == (2, 64, 128), name
    ns = run_block("docs/usage.md", "from ls_jax.interop.export import export")
    assert ns["exported_tpu"].platforms == ("tpu",)
    assert ns["exported_gpu"].platforms == ("cuda",)


ENTRY_POINTS = {"train.py": train_parser, "eval.py": eval_parser, "-m ls_jax.inference.sample": sample_parser}


def _entry_point_commands():
    """(page, command, entry point, arguments) of every train.py / eval.py / sample command."""
    found = []
    for page in PAGES:
        for command in shell_commands(page):
            if "$" in command:  # shell variables: a loop's body
                continue
            words = shlex.split(command, comments=True)
            while words and re.match(r"[A-Z_][A-Z0-9_]*=", words[0]):
                words.pop(0)  # leading VAR=value assignments
            for i, word in enumerate(words):
                rest = " ".join(words[i:i + 2])
                for entry in ENTRY_POINTS:
                    if word.endswith(entry) or rest == entry:
                        start = i + (2 if rest == entry else 1)
                        found.append(pytest.param(page, entry, words[start:],
                                                  id=f"{page}:{' '.join(words[:start + 3])}"))
                        break
    return found


@pytest.mark.parametrize("page,entry,args", _entry_point_commands())
def test_command_parses_as_written(page, entry, args):
    if args and args[0] in ("--help", "-h"):
        return
    try:
        parsed = ENTRY_POINTS[entry]().parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{page}: {entry} {' '.join(args)}: the command line refuses it ({e})")
    if entry == "train.py":
        get_config(parsed.config, parsed.overrides)  # the config and every override exist
    elif entry == "eval.py":
        # ls_jax.training.evaluate needs the training extra (grain): imported here, so that the suite
        # collects on the GPU image, which has none
        evaluate = pytest.importorskip("ls_jax.training.evaluate", exc_type=ImportError)
        evaluate.eval_config(get_config("paper"), parsed.overrides)


def test_entry_point_commands_are_found():
    entries = {p.values[1] for p in _entry_point_commands()}
    assert entries == set(ENTRY_POINTS)


@pytest.mark.parametrize("page", PAGES)
def test_configs_and_make_targets_named_exist(page):
    text = read(page)
    for name in set(re.findall(r"--config (\w+)", text)):
        assert name in CONFIGS, (page, name)
    makefile = read("Makefile")
    for target in set(re.findall(r"(?:^|`)make (?:-C \S+ )?([a-z][\w-]*)", text, re.M)):
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), (page, target)


@pytest.mark.parametrize("page", PAGES)
def test_script_flags_exist(page):
    """``python bench/X.py --flag`` and ``python -m package.module --flag``: the script exists
    and defines each flag the page passes it."""
    for command in shell_commands(page):
        pattern = r"python (?:-m )?((?:bench|experiments|ls_jax)(?:[/.]\w+)+?(?:\.py)?)(?=[ |;&]|$)((?: [^|;&]*)?)"
        for script, args in re.findall(pattern, command):
            path = script if script.endswith(".py") else script.replace(".", "/") + ".py"
            assert os.path.exists(os.path.join(ROOT, path)), (page, command)
            source = read(path)
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", args):
                assert f'"{flag}"' in source, (page, script, flag)
