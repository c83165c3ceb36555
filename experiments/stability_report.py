"""docs/stability.md, written from the result files in docs/stability/.

    python -m experiments.stability_report --write    # rewrite docs/stability.md
    python -m experiments.stability_report --check    # exit 1 when the page differs from it
    python -m experiments.stability_report            # print the page

Each folder of docs/stability/ is one run, read by what it holds: a ``results.json`` with
per-step series (``experiments.paper_batch``), a ``settings.json`` and ``points.jsonl``
(``experiments.lr_sweep``), or one folder per variant with ``config.json`` and
``metrics.jsonl`` (``experiments.stability``). ``MANIFEST`` names the folders the page is
built on, in its order; an optional one that is absent is listed as "not run", and a folder it
does not name is read and shown after the named ones. Every verdict is a rule stated on the
page (``experiments.rules`` and the constants below) applied to numbers computed here; the
paper's numbers are the constants of its claims (arXiv 2505.15548).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
import os
import sys

import numpy as np

from experiments import rules
from experiments.variants import VARIANTS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "docs", "stability")
PAGE = os.path.join(REPO, "docs", "stability.md")
COMMAND = "python -m experiments.stability_report --write"
MAX_LINES = 400  # the page's length limit (a reference, not a log)
README = os.path.join(REPO, "README.md")
# the README's verdict paragraph, written between these two lines
README_MARKERS = ("<!-- stability-verdict -->", "<!-- /stability-verdict -->")

# The paper's claims and setting (arXiv 2505.15548).
PAPER_LR = 6e-4
PAPER_SEQ_LEN = 2048
PAPER_TOKENS_PER_STEP = 256 * PAPER_SEQ_LEN
PAPER_WARMUP = 2000
PAPER_WINDOW = 51  # the author's code passes window_size=(50, 0): the query and 50 keys before it
LS_BOUND = 50  # LS keeps max |logit| below 50
MHSA_EXPLODES = 200  # MHSA's max |logit| passes 200
DIVERGE_FROM, DIVERGE_TO = 20_000, 30_000  # MHSA diverges after 20-30k steps
QKNORM_RATIO = 2 / 5  # LS reaches about 2/5 of QK-norm's perplexity
ZLOSS_FRACTION = 1 / 20  # LS reaches z-loss's perplexity with 1/20 of the GPU-hours

TRAIL = 100  # steps in one training cross-entropy mean: a step's noise out, the trend kept
# shorter sweep points end while the MHSA variants are still on the byte-level plateau, so
# they measure how soon a variant leaves it rather than the range of lrs it trains at
MIN_SWEEP_STEPS = 2000
MIN_SWEEP_LRS = 6  # a range of lrs wide enough for an expectation over it
LOGIT_MARKS = (LS_BOUND, MHSA_EXPLODES, 1e3, 1e4, 1e5, 1e6)


@dataclasses.dataclass(frozen=True)
class Planned:
    dir: str
    what: str  # what the folder is for, shown while it is "not run"
    optional: bool = False


MANIFEST = (
    Planned("paper_batch_4xH100", "LS and MHSA at the paper's batch"),
    Planned("paper_batch_baselines_4xH100", "QK-norm and z-loss at the paper's batch"),
    Planned("paper_batch_mhsa_4xH200", "MHSA past the paper's divergence range", True),
    Planned("paper_batch_ls_qknorm_4xH200", "LS and QK-norm, held-out loss during training", True),
    Planned("lr_sweep_T2048", "learning-rate sweep"),
    Planned("lr_sweep_2000_seed0", "learning-rate sweep of the verdict", True),
    Planned("lr_sweep_2000_seed1", "the same sweep's second seed", True),
    Planned("run1_T2048_lr3e-3", "short run"),
    Planned("run2_T2048_lr6e-4", "short run"),
    Planned("run3_T8192_lr6e-4", "short run"),
)


# -- formatting --------------------------------------------------------------------------------

def f_int(n) -> str:
    return "—" if n is None else f"{int(n):,}"


def f_loss(x, digits: int = 4) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def f_logit(x) -> str:
    """1.2 below 100, 8,029 below 10^4, 2.95 x 10^6 above."""
    if x is None or not math.isfinite(x):
        return "n/a"
    if x < 100:
        return f"{x:.1f}"
    if x < 1e4:
        return f"{x:,.0f}"
    e = int(math.floor(math.log10(x)))
    return f"{x / 10 ** e:.2f} x 10^{e}"


def f_lr(lr: float) -> str:
    """6e-4, 6.46e-4, 1.39e-2."""
    e = int(math.floor(math.log10(lr) + 1e-9))
    return f"{float(f'{lr / 10 ** e:.3g}'):g}e{e}"


def f_steps(a: int, b: int) -> str:
    return f"{a:,}" if a == b else f"{a:,}-{b:,}"


def f_range(lo: float, hi: float, fmt=f_loss) -> str:
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}-{fmt(hi)}"


def f_frac(x: float) -> str:
    """0.57, or 1/12 below 0.1."""
    return f"{x:.2f}" if x >= 0.1 or x == 0 else f"1/{1 / x:.0f}"


def trailing_mean(xs, window: int = TRAIL) -> np.ndarray:
    """m[i] = mean of xs[i - window + 1 .. i] (fewer at the start)."""
    xs = np.asarray(xs, np.float64)
    c = np.concatenate([[0.0], np.cumsum(xs)])
    i = np.arange(1, len(xs) + 1)
    lo = np.maximum(0, i - window)
    return (c[i] - c[lo]) / (i - lo)


def first_step(values, test) -> int | None:
    """The first step (index + 1) whose value passes ``test``, or None."""
    hit = np.nonzero(test(np.asarray(values, np.float64)))[0]
    return int(hit[0]) + 1 if hit.size else None


# -- the runs ----------------------------------------------------------------------------------

def _corpus_text(corpus: dict) -> str:
    dedup = ("deduplicated" if "duplicate_files" in corpus
             else "not deduplicated")
    return (f"`{corpus.get('source', '?')}` ({corpus.get('train_tokens', 0) / 1e6:.1f}M training "
            f"tokens, {corpus.get('validation_tokens', 0) / 1e6:.2f}M held out; {dedup})")


def _identity(corpus: dict, seed, batch, seq_len) -> tuple:
    """Runs with equal identities train on the same batches in the same order."""
    return (corpus.get("source"), corpus.get("train_tokens"), corpus.get("validation_tokens"),
            corpus.get("train_files"), seed, batch, seq_len)


@dataclasses.dataclass
class Variant:
    """One variant of a paper-batch run."""
    name: str
    run: "BatchRun"
    summary: dict
    loss: np.ndarray
    ce: np.ndarray  # the training cross-entropy: the loss less any z-loss term
    logit: np.ndarray
    evals: list  # [(step, held-out loss)] measured

    @property
    def steps(self) -> int:
        return len(self.loss)

    @functools.cached_property
    def ce_mean(self) -> np.ndarray:
        return trailing_mean(self.ce)

    @functools.cached_property
    def divergence(self) -> dict:
        return rules.divergence(self.loss)

    def gpu_hours(self, steps: int | None = None) -> float | None:
        s = self.summary
        if not s.get("train_seconds") or not s.get("steps"):
            return None
        steps = s["steps"] if steps is None else steps
        return self.run.device.get("count", 1) * steps * s["train_seconds"] / s["steps"] / 3600

    def held_out(self) -> tuple[int, float] | None:
        return self.evals[-1] if self.evals else None

    def where(self) -> str:
        return f"{self.name} ({self.run.label})"


@dataclasses.dataclass
class BatchRun:
    dir: str
    results: dict
    variants: dict

    kind = "paper batch"

    @property
    def label(self) -> str:
        return self.dir.removeprefix("paper_batch_")

    @property
    def settings(self) -> dict:
        return self.results["settings"]

    @property
    def config(self) -> dict:
        return self.settings["configs"]["ls"]

    @property
    def corpus(self) -> dict:
        return self.results.get("corpus", {})

    @property
    def device(self) -> dict:
        return self.results.get("device", {})

    @property
    def identity(self) -> tuple:
        return _identity(self.corpus, self.settings.get("seed"), self.config["train"]["batch_size"],
                         self.config["data"]["seq_len"])


def read_batch(path: str, name: str, results: dict) -> BatchRun:
    run = BatchRun(name, results, {})
    for v in [v for v in VARIANTS if v in results["variants"]] + [
            v for v in results["variants"] if v not in VARIANTS]:
        s, series = results["variants"][v], results["series"][v]
        loss = np.asarray(series["loss"], np.float64)
        evals = [(int(a), float(b)) for a, b in series.get("eval") or []]
        if not evals and s.get("final_eval_loss") is not None:
            evals = [(int(s.get("final_eval_step") or s["steps"]), float(s["final_eval_loss"]))]
        run.variants[v] = Variant(v, run, s, loss, np.asarray(series.get("ce") or loss, np.float64),
                                  np.asarray(series["max_abs_logit"], np.float64),
                                  [e for e in evals if math.isfinite(e[1])])
    return run


@dataclasses.dataclass
class Sweep:
    dir: str
    settings: dict
    points: dict  # (variant, lr) -> point
    device: dict = dataclasses.field(default_factory=dict)  # run.json's "device"

    kind = "lr sweep"

    @property
    def label(self) -> str:
        return self.dir.removeprefix("lr_sweep_")

    @property
    def corpus(self) -> dict:
        return self.settings.get("corpus_built") or {}

    @property
    def variants(self) -> list[str]:
        names = {v for v, _ in self.points}
        return [v for v in VARIANTS if v in names] + sorted(names - set(VARIANTS))

    @property
    def lrs(self) -> list[float]:
        return sorted({lr for _, lr in self.points})

    @property
    def steps(self) -> int:
        return self.settings["steps"]

    @property
    def seed(self):
        return self.settings.get("seed")

    def loss(self, v: str, lr: float) -> float | None:
        """The point's final held-out loss; None when it has none (not run, or stopped by a
        non-finite loss)."""
        x = self.points.get((v, lr), {}).get("final_eval_loss")
        return None if x is None or not math.isfinite(x) else float(x)

    def initial_loss(self, v: str) -> float:
        """The loss at initialisation: step 1's training loss, before any update (every lr of
        one seed starts from the same parameters on the same batch)."""
        firsts = [p["loss"][0] for (w, _), p in self.points.items() if w == v and p.get("loss")]
        if firsts:
            return float(np.mean(firsts))
        return math.log(self.settings["configs"][v]["model"]["vocab_size"])

    def sensitivity(self, v: str) -> tuple[float | None, float | None, float | None]:
        """(S, best loss, best lr): S = mean over the lrs of min(loss, initial loss) - best."""
        l0 = self.initial_loss(v)
        losses = {lr: self.loss(v, lr) for lr in self.lrs if (v, lr) in self.points}
        ok = {lr: x for lr, x in losses.items() if x is not None}
        if not ok:
            return None, None, None
        best_lr = min(ok, key=ok.get)
        capped = [l0 if x is None else min(x, l0) for x in losses.values()]
        return float(np.mean(capped)) - ok[best_lr], ok[best_lr], best_lr

    def base(self) -> dict:
        """The settings less the seed: sweeps with equal bases differ only in their seed."""
        s = copy.deepcopy(self.settings)
        s.pop("seed", None)
        for c in s.get("configs", {}).values():
            c.get("train", {}).pop("seed", None)
        s["corpus_built"] = {k: self.corpus.get(k) for k in
                             ("source", "train_tokens", "validation_tokens", "train_files")}
        return s


def read_sweep(path: str, name: str) -> Sweep:
    with open(os.path.join(path, "settings.json")) as f:
        settings = json.load(f)
    points = {}
    with open(os.path.join(path, "points.jsonl")) as f:
        for line in f:
            if line.strip():
                p = json.loads(line)
                points[(p["variant"], float(p["lr"]))] = p  # a rerun point: the later line
    if not points:
        raise ValueError(f"results: expected points in {path}/points.jsonl, got none")
    return Sweep(name, settings, points, read_meta(path).get("device", {}))


def read_meta(path: str) -> dict:
    """What a run's result files do not record: ``run.json`` beside them, with "commit" (the
    code the run ran) and, where the results do not name the card, "device" ({"kind": the JAX
    device kind, "count": devices per process}); {} when absent."""
    p = os.path.join(path, "run.json")
    if not os.path.exists(p):
        return {}
    with open(p) as f:
        return json.load(f)


def device_text(dev: dict) -> str:
    return f"{dev.get('count', '?')} x {dev['kind']}" if dev.get("kind") else "not recorded"


@dataclasses.dataclass
class ShortRun:
    dir: str
    variants: dict  # name -> {"config", "status", "train": records, "evals": records}
    device: dict = dataclasses.field(default_factory=dict)  # run.json's "device"

    kind = "short run"

    @property
    def label(self) -> str:
        return self.dir

    @property
    def config(self) -> dict:
        return next(iter(self.variants.values()))["config"]


def read_short(path: str, name: str, folders: list[str]) -> ShortRun:
    run = ShortRun(name, {}, read_meta(path).get("device", {}))
    for v in [v for v in VARIANTS if v in folders] + sorted(set(folders) - set(VARIANTS)):
        d = os.path.join(path, v)
        with open(os.path.join(d, "config.json")) as f:
            config = json.load(f)
        status = {}
        if os.path.exists(os.path.join(d, "status.json")):
            with open(os.path.join(d, "status.json")) as f:
                status = json.load(f)
        with open(os.path.join(d, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
        run.variants[v] = {"config": config, "status": status,
                           "train": [r for r in records if "loss" in r],
                           "evals": [r for r in records if "eval/loss" in r]}
    return run


def read_run(root: str, name: str):
    run = _read_run(root, name)
    run.commit = read_meta(os.path.join(root, name)).get("commit")
    return run


def _read_run(root: str, name: str):
    path = os.path.join(root, name)
    entries = sorted(os.listdir(path))
    if "results.json" in entries:
        with open(os.path.join(path, "results.json")) as f:
            results = json.load(f)
        if "series" in results and "variants" in results:
            return read_batch(path, name, results)
    if "points.jsonl" in entries and "settings.json" in entries:
        return read_sweep(path, name)
    folders = [e for e in entries if os.path.exists(os.path.join(path, e, "metrics.jsonl"))]
    if folders:
        return read_short(path, name, folders)
    raise ValueError(f"results: expected {path} to hold a paper_batch results.json, a sweep's "
                     f"settings.json and points.jsonl, or variant folders with metrics.jsonl; "
                     f"got {entries}")


@dataclasses.dataclass
class NotRun:
    dir: str
    what: str
    kind = "not run"


def load(root: str = RESULTS) -> list:
    """Every run of ``root``: the manifest's in its order (absent optional ones as NotRun),
    then the folders it does not name, by name."""
    present = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    runs = []
    for p in MANIFEST:
        if p.dir in present:
            runs.append(read_run(root, p.dir))
        elif p.optional:
            runs.append(NotRun(p.dir, p.what))
        else:
            raise ValueError(f"results: expected the folder {p.dir} in {root} (the page is built "
                             f"on it), got only {present}")
    named = {p.dir for p in MANIFEST}
    runs += [read_run(root, d) for d in present if d not in named]
    return runs


# -- what the runs say -------------------------------------------------------------------------

@dataclasses.dataclass
class Data:
    runs: list

    def of(self, kind) -> list:
        return [r for r in self.runs if isinstance(r, kind)]

    @property
    def batch(self) -> list[BatchRun]:
        return self.of(BatchRun)

    @property
    def sweeps(self) -> list[Sweep]:
        return self.of(Sweep)

    @property
    def short(self) -> list[ShortRun]:
        return self.of(ShortRun)

    def variants(self, name: str) -> list[Variant]:
        return [r.variants[name] for r in self.batch if name in r.variants]

    def seed_pairs(self) -> list[tuple[Sweep, Sweep]]:
        out = []
        for i, a in enumerate(self.sweeps):
            for b in self.sweeps[i + 1:]:
                if a.seed != b.seed and a.base() == b.base():
                    out.append((a, b))
        return out

    def seed_spread(self) -> dict | None:
        """delta: the largest |final loss, one seed - the other| over the points two sweeps
        that differ only in their seed share (None: no such points)."""
        diffs, excluded = [], []
        for a, b in self.seed_pairs():
            for key in sorted(set(a.points) & set(b.points)):
                x, y = a.loss(*key), b.loss(*key)
                if x is None or y is None:
                    continue
                # a divergence is counted by the divergence rule, not as seed noise
                if a.points[key].get("diverged") or b.points[key].get("diverged"):
                    excluded.append((key, x, y, abs(x - y), a, b))
                else:
                    diffs.append((key, x, y, abs(x - y), a, b))
        if not diffs:
            return None
        return {"delta": max(d[3] for d in diffs), "mean": float(np.mean([d[3] for d in diffs])),
                "n": len(diffs), "diffs": diffs, "excluded": excluded}

    @property
    def delta(self) -> float:
        s = self.seed_spread()
        return 0.0 if s is None else s["delta"]

    def verdict_sweep(self) -> Sweep | None:
        """The sweep that decides: the most steps a point among those with at least
        MIN_SWEEP_STEPS steps and MIN_SWEEP_LRS lrs for every variant (the first seed first)."""
        ok = [s for s in self.sweeps if s.steps >= MIN_SWEEP_STEPS and all(
            sum(1 for w, _ in s.points if w == v) >= MIN_SWEEP_LRS for v in VARIANTS)]
        return max(ok, key=lambda s: (s.steps, -(s.seed or 0)), default=None)

    def longest_sweep(self) -> Sweep | None:
        return max(self.sweeps, key=lambda s: (s.steps, len(s.points), -(s.seed or 0)), default=None)


def identical(a: Variant, b: Variant) -> bool:
    return a.run is b.run or a.run.identity == b.run.identity


def pairs(data: Data, other: str) -> list[tuple[Variant, Variant]]:
    """(LS, other) on identical batches, one pair per run holding ``other``: the LS of that
    run, else the LS of another run with identical batches that ran the most common steps."""
    out = []
    for b in data.variants(other):
        same = b.run.variants.get("ls")
        found = [same] if same is not None else [a for a in data.variants("ls") if identical(a, b)]
        if found:
            out.append((max(found, key=lambda a: min(a.steps, b.steps)), b))
    return out


def best_pair(ps: list, by_held_out: bool = True):
    """The pair that decides: measured held-out points in common first (when asked), then
    one run for both, then the most common steps."""
    return min(ps, key=lambda p: (by_held_out and not common_held_out(*p), p[0].run is not p[1].run,
                                  -min(p[0].steps, p[1].steps)), default=None)


def common_held_out(a: Variant, b: Variant) -> list[tuple[int, float, float]]:
    ea, eb = dict(a.evals), dict(b.evals)
    return [(s, ea[s], eb[s]) for s in sorted(set(ea) & set(eb))]


def lead(a: Variant, b: Variant) -> dict:
    """Who is lower on the TRAIL-step means of the training cross-entropy, over the steps both
    ran with a finite loss: d = b - a (positive: a lower); the last stretch of one sign and
    the crossings before it."""
    finite = np.isfinite(a.ce[:min(a.steps, b.steps)]) & np.isfinite(b.ce[:min(a.steps, b.steps)])
    n = int(np.argmin(finite)) if not finite.all() else len(finite)
    d = b.ce_mean[:n] - a.ce_mean[:n]
    sign = np.sign(d)
    changes = np.nonzero(sign[1:] != sign[:-1])[0]
    start = int(changes[-1]) + 1 if changes.size else 0
    return {"n": n, "end": float(d[-1]), "a": float(a.ce_mean[n - 1]), "b": float(b.ce_mean[n - 1]),
            "from": start + 1, "hi": float(np.max(np.abs(d[start:]))),
            "crossings": int(changes.size)}


def lead_text(a: Variant, b: Variant) -> str:
    g = lead(a, b)
    if g["end"] == 0:
        return f"level at step {g['n']:,}"
    since = "at every step" if g["from"] == 1 else f"from step {g['from']:,} on"
    return (f"{a.name if g['end'] > 0 else b.name} lower {since} (by up to {g['hi']:.3f}; "
            f"{g['crossings']} crossing{'s' if g['crossings'] != 1 else ''})")


def compare(delta_other_minus_ls: float, margin: float) -> str:
    if delta_other_minus_ls > margin:
        return "lower"
    if delta_other_minus_ls < -margin:
        return "higher"
    return "level"


def margin_text(data: Data) -> str:
    s = data.seed_spread()
    return "one seed, δ not measured" if s is None else f"δ = {s['delta']:.4f}"


def spike_of(losses) -> tuple[int, float, int | None]:
    """(spikes, largest ratio, its step)."""
    r = rules.spike_ratios(losses)
    if not r.size:
        return 0, math.nan, None
    k = int(np.argmax(r))
    return int(np.sum(r > rules.SPIKE_FACTOR)), float(r[k]), k + 2


def held_text(d: dict) -> str:
    if not d["held"]:
        return "never"
    return ", ".join(f_steps(a, b) for a, b in d["held"])


# -- the claims --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Claim:
    claim: str  # the paper's, or our question
    evidence: str  # the numbers, computed
    label: str  # the rule's outcome: "reproduced", "not tested", ...
    detail: str  # the numbers the outcome rests on
    rule: str

    @property
    def verdict(self) -> str:
        return f"**{self.label}**" + (f": {self.detail}" if self.detail else "")


def claim_logits(data: Data) -> Claim:
    parts, ok, peaks_mhsa, peaks_ls = [], [], [], []
    for v in data.variants("mhsa"):
        above = first_step(v.logit, lambda x: x > MHSA_EXPLODES)
        k = int(np.nanargmax(v.logit))
        parts.append(f"MHSA ({v.run.label}, {v.steps:,} steps) passes {MHSA_EXPLODES} at step "
                     f"{f_int(above)} and peaks at {f_logit(v.logit[k])} (step {k + 1:,})")
        ok.append(above is not None)
        peaks_mhsa.append(float(v.logit[k]))
    for v in data.variants("ls"):
        parts.append(f"LS ({v.run.label}) peaks at {f_logit(np.nanmax(v.logit))} over "
                     f"{v.steps:,} steps")
        ok.append(bool(np.nanmax(v.logit) < LS_BOUND))
        peaks_ls.append(float(np.nanmax(v.logit)))
    for name in ("mhsa_zloss", "mhsa_qknorm"):
        for v in data.variants(name):
            parts.append(f"{name} ({v.run.label}) peaks at {f_logit(np.nanmax(v.logit))}")
    peaks = {n: [max(x["max_abs_logit"] for x in r.variants[n]["train"])
                 for r in data.short if n in r.variants] for n in ("ls", "mhsa")}
    if peaks["mhsa"]:
        parts.append(f"short runs: MHSA passes {MHSA_EXPLODES} in "
                     f"{sum(x > MHSA_EXPLODES for x in peaks['mhsa'])} of {len(peaks['mhsa'])} "
                     f"(peaks {', '.join(f_logit(x) for x in peaks['mhsa'])}), LS peaks at "
                     f"{f_logit(max(peaks['ls'], default=math.nan))} at most")
    for s in data.sweeps:
        if s.steps != max(w.steps for w in data.sweeps) or s.seed != min(
                w.seed for w in data.sweeps if w.steps == s.steps):
            continue
        ls = {lr: s.points[("ls", lr)].get("peak_max_abs_logit") for lr in s.lrs
              if ("ls", lr) in s.points}
        below = [lr for lr, x in ls.items() if x is not None and x < LS_BOUND]
        above = [lr for lr, x in ls.items() if x is None or x >= LS_BOUND]
        txt = (f"sweep {s.label}: LS's peak is below {LS_BOUND} at lr "
               f"{', '.join(map(f_lr, below)) or 'none'}")
        if above:
            top = max(above)
            txt += (f", not at {', '.join(map(f_lr, above))} (from {min(above) / PAPER_LR:.1f}x "
                    f"the paper's lr; {f_logit(ls[top])} at {f_lr(top)})")
        parts.append(txt)
    if not data.variants("mhsa") or not data.variants("ls"):
        label, detail = "not tested", "no paper-batch run of LS and MHSA"
    else:
        label = "reproduced" if all(ok) else "not reproduced"
        detail = (f"MHSA's peak {f_logit(min(peaks_mhsa))} or more, LS's {f_logit(max(peaks_ls))} "
                  "at most, at the paper's batch and lr")
    return Claim(f"MHSA's attention logits grow (max \\|logit\\| > {MHSA_EXPLODES}); LS keeps "
                 f"them below {LS_BOUND}", "; ".join(parts) + ".", label, detail,
                 f"every paper-batch MHSA run passes {MHSA_EXPLODES} and every LS run stays "
                 f"below {LS_BOUND}")


def claim_spikes(data: Data) -> Claim:
    parts, mhsa_spikes = [], []
    for name in VARIANTS:
        for v in data.variants(name):
            n, ratio, at = spike_of(v.loss)
            parts.append(f"{v.where()} {n} (largest {ratio:.2f}x, step {f_int(at)})")
            if name == "mhsa":
                mhsa_spikes.append(n)
    other = []
    for r in data.short:
        other += [rules.count_spikes([x["loss"] for x in d["train"]]) for d in r.variants.values()]
    for s in data.sweeps:
        other += [p.get("spikes") or 0 for p in s.points.values()]
    if other:
        parts.append(f"the short runs and sweeps: {sum(other)} in {len(other)} runs and points")
    if not mhsa_spikes:
        label, detail = "not tested", "no paper-batch run of MHSA"
    else:
        label = "reproduced" if any(mhsa_spikes) else "not reproduced"
        detail = f"{sum(mhsa_spikes)} spikes of MHSA"
    return Claim("MHSA's loss spikes", "Spikes at the paper's batch: " + "; ".join(parts) + ".",
                 label, detail, "a spike of MHSA at the paper's batch")


def claim_divergence(data: Data) -> Claim:
    claim = f"MHSA diverges after {DIVERGE_FROM // 1000}-{DIVERGE_TO // 1000}k steps"
    rule = (f"the divergence rule at the end of the longest paper-batch MHSA run; tested from "
            f"{DIVERGE_FROM:,} steps")
    mhsa = sorted(data.variants("mhsa"), key=lambda v: -v.steps)
    if not mhsa:
        return Claim(claim, "No paper-batch run of MHSA.", "not tested", "", rule)
    parts = []
    for v in mhsa + data.variants("mhsa_zloss"):
        d = v.divergence
        parts.append(f"{v.where()}, {v.steps:,} steps: ratio {d['end_ratio']:.2f} at the end, "
                     f"at most {d['max_ratio']:.2f} (step {f_int(d['max_at'])}); the rule held at "
                     f"steps {held_text(d)}" + (f"; non-finite loss at step {d['non_finite_at']:,}"
                                                if d["non_finite_at"] else ""))
    v = mhsa[0]
    d = v.divergence
    if d["end_ratio"] > rules.BLOWUP_FACTOR or d["non_finite_at"] is not None:
        first, at = d["held"][0][0], d["held"][-1][0]
        label = "reproduced" if at >= DIVERGE_FROM else "diverged earlier than the paper's range"
        detail = (f"the rule first held at step {first:,} and holds from step {at:,} to the end "
                  f"({v.steps:,})")
    elif v.steps < DIVERGE_FROM:
        label, detail = "not tested", f"MHSA ran {v.steps:,} steps"
    else:
        label = "not seen" if v.steps < DIVERGE_TO else "not reproduced"
        detail = f"MHSA ran {v.steps:,} steps, ratio {d['end_ratio']:.2f} at the end"
    return Claim(claim, "; ".join(parts) + ".", label, detail, rule)


def _pair_measure(a: Variant, b: Variant) -> tuple[str, float, str]:
    """(what, b - a, text) at the last common held-out step, else on the TRAIL-step training
    cross-entropy means at the last common step."""
    common = common_held_out(a, b)
    if common:
        s, x, y = common[-1]
        return (f"held-out loss at step {s:,}", y - x,
                f"held-out at step {s:,}: LS {x:.4f}, {b.name} {y:.4f}")
    g = lead(a, b)
    return (f"training cross-entropy at step {g['n']:,}", g["end"],
            f"held-out not measured at a common step; training cross-entropy, steps "
            f"{max(1, g['n'] - TRAIL + 1):,}-{g['n']:,}: LS {g['a']:.4f}, {b.name} {g['b']:.4f}")


def _runs_of(a: Variant, b: Variant) -> str:
    return a.run.label if a.run is b.run else f"{a.run.label} and {b.run.label}"


def claim_loss(data: Data) -> Claim:
    claim, rule = "LS has a lower loss than MHSA", "LS lower by more than δ at the paper's batch"
    ps = pairs(data, "mhsa")
    parts = [f"{_runs_of(a, b)}: {_pair_measure(a, b)[2]}; {lead_text(a, b)}" for a, b in ps]
    for r in data.short:
        if "ls" in r.variants and "mhsa" in r.variants and all(
                r.variants[v]["evals"] for v in ("ls", "mhsa")):
            x, y = (r.variants[v]["evals"][-1]["eval/loss"] for v in ("ls", "mhsa"))
            parts.append(f"{r.label}: held-out LS {x:.4f}, MHSA {y:.4f}")
    for s in data.sweeps:
        both = [lr for lr in s.lrs if s.loss("ls", lr) is not None and s.loss("mhsa", lr) is not None]
        lower = [lr for lr in both if s.loss("ls", lr) < s.loss("mhsa", lr)]
        parts.append(f"sweep {s.label}: LS below MHSA at {len(lower)} of {len(both)} lrs")
    if not ps:
        return Claim(claim, "; ".join(parts) + ".", "not tested", "at the paper's batch", rule)
    what, diff, _ = _pair_measure(*best_pair(ps))
    c = compare(diff, data.delta)
    return Claim(claim, "; ".join(parts) + ".", "reproduced" if c == "lower" else "not reproduced",
                 f"LS {c} by {abs(diff):.4f} on the {what}; {margin_text(data)}", rule)


def claim_qknorm(data: Data) -> Claim:
    claim = "LS reaches about 2/5 of QK-norm's perplexity"
    rule = ("LS's held-out loss (else its training cross-entropy) on identical batches lower "
            "than QK-norm's by more than δ; a per-byte ratio r is r^b per token of b bytes")
    ps = pairs(data, "mhsa_qknorm")
    if not ps:
        return Claim(claim, "No paper-batch run of LS and QK-norm on identical batches.",
                     "not tested", "", rule)
    a, b = best_pair(ps)
    what, diff, text = _pair_measure(a, b)
    ratio = math.exp(-diff)  # LS's perplexity over QK-norm's, per byte
    evidence = (f"{_runs_of(a, b)}: {text}; perplexity ratio per byte {ratio:.3f}; "
                f"{lead_text(a, b)}.")
    c = compare(diff, data.delta)
    if c == "lower":
        label = "direction reproduced"
        detail = (f"LS lower by {diff:.4f} on the {what}; its per-byte ratio {ratio:.3f} is 2/5 "
                  f"per token at {math.log(QKNORM_RATIO) / math.log(ratio):.1f} bytes per token")
    elif c == "level":
        label, detail = "not reproduced", f"level on the {what} (\\|Δ\\| {abs(diff):.4f})"
    else:
        label, detail = "not reproduced", f"QK-norm lower by {-diff:.4f} on the {what}"
    return Claim(claim, evidence, label, f"{detail}; {margin_text(data)}", rule)


def zloss_pair(data: Data) -> tuple[Variant, Variant] | None:
    return best_pair([(a, b) for a, b in pairs(data, "mhsa_zloss")
                      if b.evals and a.run.device.get("kind") == b.run.device.get("kind")
                      and a.gpu_hours() is not None and b.gpu_hours() is not None],
                     by_held_out=False)


def claim_zloss(data: Data) -> Claim:
    claim = "LS reaches z-loss's perplexity with 1/20 of the GPU-hours"
    rule = ("LS's GPU-hours to reach z-loss's best point over z-loss's GPU-hours to it: 1/20 or "
            "less reproduces; held-out points decide when they bracket the fraction on one side, "
            "else the training cross-entropy")
    p = zloss_pair(data)
    if p is None:
        return Claim(claim, "No paper-batch run of LS and z-loss on identical batches and one "
                     "kind of card.", "not tested", "", rule)
    ls, zl = p
    zs, target = min(zl.evals, key=lambda e: e[1])
    z_hours = zl.gpu_hours(zs)
    end_s, end_loss = zl.evals[-1]
    parts = [f"{_runs_of(ls, zl)}: z-loss's best held-out loss is {target:.4f} at step {zs:,} "
             f"({z_hours:.3f} GPU-hours; {end_loss:.4f} at its last point, step {end_s:,})"]
    hi = next((s for s, x in ls.evals if x <= target), None)
    lo = max([s for s, x in ls.evals if x > target and (hi is None or s < hi)], default=0)
    bracket = None
    if hi is not None:
        bracket = (ls.gpu_hours(lo) / z_hours, ls.gpu_hours(hi) / z_hours)
        parts.append(f"LS's held-out loss is above it at step {lo:,} and at or below it at step "
                     f"{hi:,}: {f_frac(bracket[0])} to {f_frac(bracket[1])} of z-loss's GPU-hours"
                     if lo else f"LS's first held-out point, at step {hi:,}, is at or below it: "
                     f"at most {f_frac(bracket[1])} of z-loss's GPU-hours")
    zc = zl.ce_mean
    zcs = int(np.argmin(zc)) + 1
    ls_s = first_step(ls.ce_mean, lambda x: x <= zc[zcs - 1])
    ce_frac = None if ls_s is None else ls.gpu_hours(ls_s) / zl.gpu_hours(zcs)
    parts.append(f"training cross-entropy ({TRAIL}-step means): z-loss's best is "
                 f"{zc[zcs - 1]:.4f} at step {zcs:,}, which LS reaches "
                 + ("never" if ls_s is None else
                    f"at step {ls_s:,}, with {f_frac(ce_frac)} of the GPU-hours"))

    def outcome(f):
        return ("reproduced" if f <= ZLOSS_FRACTION else "not reproduced",
                "LS is faster, not 20x" if ZLOSS_FRACTION < f < 1 else
                "LS is not faster" if f >= 1 else "")

    if bracket is not None and outcome(bracket[0]) == outcome(bracket[1]):
        label, why = outcome(bracket[1])
        detail = (f"{why}: {f_frac(bracket[0])} to {f_frac(bracket[1])} of the GPU-hours on the "
                  "held-out loss")
    elif ce_frac is not None:
        label, why = outcome(ce_frac)
        detail = f"{why}: {f_frac(ce_frac)} of the GPU-hours on the training cross-entropy"
    else:
        label, detail = "not tested", "LS does not reach z-loss's best"
    return Claim(claim, "; ".join(parts) + ".", label, detail.lstrip(": "), rule)


def claim_sensitivity(data: Data) -> Claim:
    claim = ("LS trains well over a wider range of peak lrs than MHSA (our question; the paper "
             "claims better stability)")
    rule = (f"LS's S below every MHSA variant's by more than 4δ, in the sweep with the most steps "
            f"a point among those of >= {MIN_SWEEP_STEPS:,} steps and >= {MIN_SWEEP_LRS} lrs")
    s = data.verdict_sweep()
    shown = s or data.longest_sweep()
    if shown is None:
        return Claim(claim, "No sweep.", "not tested", "", rule)
    sens = {v: shown.sensitivity(v)[0] for v in shown.variants}
    evidence = (f"sweep {shown.label} ({shown.steps:,} steps a point, {len(shown.lrs)} lrs): S "
                + ", ".join(f"{v} {x:.3f}" for v, x in sens.items() if x is not None))
    if s is None:
        return Claim(claim, evidence + ".", "not tested",
                     f"the longest sweep has {shown.steps:,} steps a point", rule)
    margin = 4 * data.delta
    groups = {"lower": [], "level": [], "higher": []}
    for v in s.variants:
        if v != "ls" and sens[v] is not None and sens.get("ls") is not None:
            groups[compare(sens[v] - sens["ls"], margin)].append(v)
    said = "; ".join(f"LS's S {k} than {', '.join(vs)}" if k != "level" else
                     f"level with {', '.join(vs)}" for k, vs in groups.items() if vs)
    if groups["higher"]:
        label = "no"
    elif groups["level"]:
        label = "not shown within the margin"
    else:
        label = "yes"
    return Claim(claim, f"{evidence}; 4δ = {margin:.4f}.", label, said, rule)


CLAIMS = (claim_logits, claim_spikes, claim_divergence, claim_loss, claim_qknorm, claim_zloss,
          claim_sensitivity)


# -- the page ----------------------------------------------------------------------------------

def _esc(text: str) -> str:
    return text.replace("|", "\\|")


def section_verdict(claims: list[Claim]) -> list[str]:
    lines = ["## Verdict, claim by claim", "",
             "| claim | measured here | verdict (rule) |", "|---|---|---|"]
    for c in claims:
        lines.append(f"| {c.claim} | {_esc(c.evidence)} | {_esc(c.verdict)}. Rule: {_esc(c.rule)}. |")
    return lines + [""]


def section_rules(data: Data) -> list[str]:
    s = data.seed_spread()
    delta = ("not measured: no two sweeps differ only in their seed, so every difference "
             "counts" if s is None else
             f"{s['delta']:.4f}, the largest over the {s['n']} points two sweeps share in "
             f"which neither seed diverged (mean {s['mean']:.4f}; a point that diverged under "
             f"one seed only is counted by the divergence rule); it is measured at the sweep's scale and stands in for "
             f"the spread of every run")
    return [
        "## Rules", "",
        "- **max \\|logit\\|**: the largest \\|q.k / sqrt(head_dim)\\| over layers, heads, "
        "batch and allowed (query, key) pairs at a step, from the attention kernel's statistics "
        "in the training forward pass.",
        f"- **Spike**: a logged loss > {rules.SPIKE_FACTOR}x the median of the "
        f"{rules.SPIKE_WINDOW} logged losses before it (every step at the paper's batch and in "
        "the sweeps" + "".join(f", every {n}th in the short runs" for n in sorted(
            {r.config["train"]["log_every"] for r in data.short})) + "); \"largest\" is the "
        "highest such ratio.",
        f"- **Diverged**: a non-finite loss, or the median of the last {rules.TAIL_FRACTION:.0%} "
        f"of a run's losses is > {rules.BLOWUP_FACTOR}x its best {rules.RUNNING}-loss running "
        "median. The ratio is given at the end; applied to every prefix of the run it also "
        "gives the steps at which the rule held.",
        f"- **Training cross-entropy**: the mean of the {TRAIL} steps up to a step, without "
        "z-loss's term. Runs with the same corpus, seed, batch and sequence length train on the "
        "same batches in the same order (identical batches).",
        f"- **Margin δ**: the seed-to-seed spread of the final held-out loss: {delta}. A "
        "difference counts when it is larger than δ (\"lower\", \"higher\"), else \"level\".",
        "- **GPU-hours**: GPUs x seconds per step x steps; compared only between runs on one "
        "kind of card.",
        "- **LR sensitivity S** (Wortsman et al. 2023): over the K peak lrs η_k of a sweep, "
        "S = (1/K) Σ_k min(L(η_k), L0) − min_k L(η_k), with L the final held-out loss (a "
        "point without a finite one counts as L0) and L0 the loss at initialisation (step 1's "
        "training loss). Lower S: the lrs cost less against the best one. A difference in S "
        "counts when it exceeds 4δ (a seed change of up to δ per point moves each S by up to "
        "2δ).",
        "",
    ]


def section_caveats(data: Data) -> list[str]:
    seeds = {r.dir: r.settings.get("seed") for r in data.batch}
    seeds.update({s.dir: s.seed for s in data.sweeps})
    seeds.update({r.dir: r.config["train"]["seed"] for r in data.short})
    common = max(set(seeds.values()), key=list(seeds.values()).count)
    others = [f"{d} (seed {s})" for d, s in seeds.items() if s != common]
    pairs_ = data.seed_pairs()
    seed_txt = (f"Every run uses seed {common}" + (f" but {', '.join(others)}" if others else "")
                + ("; no run is repeated with another seed, so each difference on this page is "
                   "one measurement" if not pairs_ else
                   "; repeated with another seed: " + ", ".join(
                       f"{len(set(a.points) & set(b.points))} points of {a.dir} in {b.dir}"
                       for a, b in pairs_)
                   + "; the paper-batch runs have one seed each"))
    lines = ["## Caveats", "", f"- **Seeds.** {seed_txt}."]
    ann = []
    for r in data.batch:
        t = r.config["train"]
        ends = [v.summary.get("lr_at_end") for v in r.variants.values() if v.summary.get("lr_at_end")]
        if ends:
            ann.append(f"{r.dir}: lr at the last step {f_range(min(ends) / t['lr'], max(ends) / t['lr'], lambda x: f'{x:.2f}')} "
                       f"of the peak (the cosine reaches {f_lr(t['min_lr'])} at step {t['num_steps']:,})")
    done = ([s.dir for s in data.sweeps
             if all(c["train"]["num_steps"] == s.steps for c in s.settings["configs"].values())]
            + [r.dir for r in data.short if all(
                d["train"] and d["train"][-1]["step"] >= d["config"]["train"]["num_steps"]
                for d in r.variants.values())])
    if ann:
        lines.append("- **The lr had not annealed** at the end of the paper-batch runs, so their "
                     "final losses are not those of a finished schedule: " + "; ".join(ann)
                     + "." + (f" These end their cosine at their last step: {', '.join(done)}."
                              if done else ""))
    corp: dict[str, list[str]] = {}
    for r in data.batch + data.sweeps:
        corp.setdefault(_corpus_text(r.corpus), []).append(r.dir)
    for r in data.short:
        d = r.config["data"]
        corp.setdefault(f"`{d['source']}` through the library's pipeline, "
                        f"{d['validation_percent']}% of the files held out (size not recorded)",
                        []).append(r.dir)
    raw = [r.dir for r in data.batch + data.sweeps if "duplicate_files" not in r.corpus]
    lines.append("- **Corpora** (bytes of the machine's own files, `experiments/byte_corpus.py`; "
                 "not PG-19): " + "; ".join(
        f"{', '.join(names)}: {text}" for text, names in corp.items()) + "." + (
        "" if not raw else f" {', '.join(raw)}: built before duplicates were dropped, so a file "
        "installed twice can be both trained on and held out, and the held-out loss can be "
        "optimistic."))
    ep = []
    for r in data.batch:
        e = [v.summary.get("epochs") for v in r.variants.values() if v.summary.get("epochs")]
        gaps = [(v.name, v.held_out()[1] - v.ce_mean[v.held_out()[0] - 1]) for v in r.variants.values()
                if v.held_out()]
        if e:
            ep.append(f"{r.dir} {f_range(min(e), max(e), lambda x: f'{x:.1f}')} epochs (held-out "
                      "minus training cross-entropy at the last held-out point: "
                      + ", ".join(f"{n} {g:+.3f}" for n, g in gaps) + ")")
    for s in data.sweeps:
        e = {p.get("epochs") for p in s.points.values() if p.get("epochs") is not None}
        if e:
            ep.append(f"{s.dir} {f_range(min(e), max(e), lambda x: f'{x:.2f}')} epochs a point")
    if ep:
        lines.append("- **Epochs seen** (passes over the training split): " + "; ".join(ep)
                     + ". Runs compared on identical batches saw the same data, but absolute "
                     "losses after several epochs include memorisation.")
    kinds = sorted({r.device.get("kind", "?") for r in data.batch})
    if len(kinds) > 1:
        lines.append(f"- **Cards**: the paper-batch runs ran on {', '.join(kinds)}; their "
                     "GPU-hours are compared within one kind only.")
    return lines + [""]


def _batch_command(r: BatchRun) -> str:
    s = r.settings
    cmd = (f"python -m experiments.paper_batch --out OUT --variants {','.join(r.variants)} "
           f"--corpus {s['corpus']['source']}")
    if s.get("max_steps"):
        cmd += f" --max-steps {s['max_steps']}"
    if s.get("corpus", {}).get("max_mb"):
        cmd += f" --corpus-mb {s['corpus']['max_mb']}"
    if s.get("seed"):
        cmd += f" --seed {s['seed']}"
    return cmd


def _sweep_command(s: Sweep) -> str:
    cmd = (f"python -m experiments.lr_sweep --out OUT --steps {s.steps} --lrs "
           f"{','.join(f'{lr:g}' for lr in s.lrs)} --variants {','.join(s.variants)} "
           f"--corpus {s.settings['corpus']['source']} --seed {s.seed}")
    cap = s.settings["corpus"].get("max_mb")
    return cmd + (f"`, with the corpus capped at {cap} MB (the preset's `max_corpus_mb`)"
                   if cap else "`")


def _short_command(r: ShortRun) -> str:
    c = r.config
    v = next(iter(r.variants))
    preset = c["name"].removeprefix("stability_").removesuffix(f"_{v}")
    t = c["train"]
    return (f"python -m experiments.stability --out OUT --preset {preset} "
            f"train.num_steps={t['num_steps']} train.lr={t['lr']:g} train.min_lr={t['min_lr']:g} "
            f"model.window={c['model']['window']}")


def section_runs(data: Data) -> list[str]:
    lines = ["## The runs", "",
             "| run | kind | device | code at | variants | batch x T | steps | peak lr (warmup; cosine to, at step) | corpus | seed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data.runs:
        if isinstance(r, NotRun):
            lines.append(f"| `{r.dir}` | not run | | | {r.what} | | | | | |")
            continue
        if isinstance(r, BatchRun):
            cfg, dev = r.config, r.device
            device = device_text(dev)
            steps = ", ".join(f"{v.name} {v.steps:,}" for v in r.variants.values())
            corpus, seed = _corpus_text(r.corpus), r.settings.get("seed")
            lrs = f_lr(cfg["train"]["lr"])
        elif isinstance(r, Sweep):
            cfg, device = r.settings["configs"]["ls"], device_text(r.device)
            steps = f"{r.steps:,} a point"
            corpus, seed = _corpus_text(r.corpus), r.seed
            lrs = f"{len(r.lrs)} lrs, {f_lr(r.lrs[0])} to {f_lr(r.lrs[-1])}"
            cfg = copy.deepcopy(cfg)
            cfg["train"]["min_lr"] = None
        else:
            cfg, device = r.config, device_text(r.device)
            steps = f"{max(len(d['train']) and d['train'][-1]['step'] for d in r.variants.values()):,}"
            corpus = f"`{cfg['data']['source']}` (size not recorded)"
            seed = cfg["train"]["seed"]
            lrs = f_lr(cfg["train"]["lr"])
        t = cfg["train"]
        sched = (f"{t['warmup_steps']:,}; peak/10 at the last step" if t.get("min_lr") is None
                 else f"{t['warmup_steps']:,}; {f_lr(t['min_lr'])} at {t['num_steps']:,}")
        lines.append(f"| [`{r.dir}`](stability/{r.dir}/) | {r.kind} | {device} | "
                     f"{r.commit or 'not recorded'} | {', '.join(r.variants)} | {t['batch_size']} x {cfg['data']['seq_len']} | "
                     f"{steps} | {lrs} ({sched}) | {corpus} | {seed} |")
    return lines + [""]


def _plot(root: str, r, name: str) -> list[str]:
    return ([f"![{r.dir}](stability/{r.dir}/{name})", ""]
            if os.path.exists(os.path.join(root, r.dir, name)) else [])


def section_batch(data: Data, root: str) -> list[str]:
    if not data.batch:
        return []
    cfg = data.batch[0].config
    m = cfg["model"]
    lines = ["## At the paper's batch", "",
             f"The paper's configs with byte tokens: {m['n_layer']} layers, {m['n_head']} heads x "
             f"{m['head_dim']}, d={m['d_model']}, {m['compute_dtype']}; LS = "
             f"{m['n_global_heads']} global + {m['n_head'] - m['n_global_heads']} local heads "
             f"(p={m['window']}); data-parallel, each step asking for the logit statistics. "
             f"Held-out loss: cross-entropy over {data.batch[0].settings['eval_batches']} fixed "
             f"held-out batches. Δ below is the other variant's value minus LS's.", ""]
    for r in data.batch:
        dev = r.device
        lines += [f"### {', '.join(r.variants)} ({r.label})", "",
                  f"{dev.get('count', '?')} x {dev.get('kind', '?')}; corpus "
                  f"{_corpus_text(r.corpus)}; seed {r.settings.get('seed')}. "
                  f"`{_batch_command(r)}`"
                  + (" (stopped by its time budget at the steps shown)."
                     if any(v.summary.get("state") == "stopped" for v in r.variants.values())
                     else "."), "",
                  "| variant | steps (state) | epochs | lr at end | train CE, last 100 steps | "
                  "held-out (step) | max abs logit: end / peak (step) | top head at end (layer, "
                  "head) | spikes (largest ratio) | divergence ratio at end (rule held at) | "
                  "tokens/s | GPU-hours |", "|---|" + "---|" * 11]
        for v in r.variants.values():
            s = v.summary
            ho = v.held_out()
            k = int(np.nanargmax(v.logit))
            top = s.get("final_top_head")
            n, ratio, _ = spike_of(v.loss)
            d = v.divergence
            gh = v.gpu_hours()
            lines.append(
                f"| {v.name} | {v.steps:,} ({s.get('state')}) | "
                f"{'n/a' if s.get('epochs') is None else format(s['epochs'], '.2f')} | "
                f"{f_lr(s['lr_at_end']) if s.get('lr_at_end') else 'n/a'} | "
                f"{v.ce_mean[-1]:.4f} | "
                f"{'n/a' if ho is None else f'{ho[1]:.4f} ({ho[0]:,})'} | "
                f"{f_logit(v.logit[-1])} / {f_logit(v.logit[k])} ({k + 1:,}) | "
                f"{'n/a' if not top else f'{f_logit(top['value'])} ({top['layer']}, {top['head']})'} | "
                f"{n} ({ratio:.2f}x) | {d['end_ratio']:.2f} ({held_text(d)}) | "
                f"{s.get('tokens_per_sec', 0) / 1e6:.1f}M | {'n/a' if gh is None else f'{gh:.3f}'} |")
        lines += [""] + _plot(root, r, "paper_batch.png")
    marks = " | ".join(f"> {x:,.0f}" if x < 1e3 else f"> 10^{round(math.log10(x))}"
                       for x in LOGIT_MARKS)
    lines += ["### Logit growth: first step with max \\|logit\\| above", "",
              f"| variant (run) | {marks} |", "|---|" + "---|" * len(LOGIT_MARKS)]
    for r in data.batch:
        for v in r.variants.values():
            lines.append(f"| {v.where()} | " + " | ".join(
                f_int(first_step(v.logit, lambda x, t=t: x > t)) for t in LOGIT_MARKS) + " |")
    lines.append("")
    curves = [v for r in data.batch for v in r.variants.values() if len(v.evals) > 1]
    if curves:
        steps = sorted({s for v in curves for s, _ in v.evals})
        lines += ["### Held-out loss during training (nats/byte)", "",
                  "| step | " + " | ".join(v.where() for v in curves) + " |",
                  "|---|" + "---|" * len(curves)]
        for st in steps:
            lines.append(f"| {st:,} | " + " | ".join(
                f_loss(dict(v.evals).get(st)) if st in dict(v.evals) else "" for v in curves) + " |")
        lines.append("")
    rows = []
    for other in VARIANTS[1:]:
        for a, b in pairs(data, other):
            common = common_held_out(a, b)
            g = lead(a, b)
            held = ("not measured at a common step" if not common else
                    f"{common[-1][1]:.4f} / {common[-1][2]:.4f} ({common[-1][2] - common[-1][1]:+.4f}) "
                    f"at {common[-1][0]:,}")
            rows.append(f"| {other} | {a.run.label}{'' if a.run is b.run else ' / ' + b.run.label} | "
                        f"{g['n']:,} | {g['a']:.4f} / {g['b']:.4f} ({g['end']:+.4f}) | "
                        f"{lead_text(a, b)} | {held} |")
    if rows:
        lines += ["### LS against each variant on identical batches", "",
                  "| LS against | runs | common steps | train CE at the last common step: LS / "
                  "other (Δ) | lower on the 100-step means | held-out: LS / other (Δ) |",
                  "|---|---|---|---|---|---|", *rows, ""]
    return lines


def section_sweeps(data: Data, root: str) -> list[str]:
    if not data.sweeps:
        return []
    lines = ["## Learning-rate sweeps", "",
             "Each point trains from the same initialisation on the same batches; only the peak "
             "lr differs. Final loss: held-out cross-entropy (nats/byte) at the last step; **bold**: "
             "the variant's best lr; S: the LR sensitivity (Rules). The last row names the lowest "
             "variant at each lr and its lead over the next.", ""]
    for s in data.sweeps:
        cfg = s.settings["configs"]["ls"]
        eps = {p.get("epochs") for p in s.points.values() if p.get("epochs") is not None}
        n_div = sum(bool(p["diverged"]) for p in s.points.values())
        n_spk = sum(p.get("spikes") or 0 for p in s.points.values())
        tok = s.steps * s.settings["batch_size"] * s.settings["seq_len"]
        head = "| variant | " + " | ".join(f_lr(lr) for lr in s.lrs) + " | best lr | S |"
        sep = "|---|" + "---|" * (len(s.lrs) + 2)
        lines += [f"### {s.steps:,} steps a point, seed {s.seed} ({s.label})", "",
                  f"T={s.settings['seq_len']}, batch {s.settings['batch_size']} ({tok / 1e6:.1f}M "
                  f"tokens a point, {f_range(min(eps), max(eps), lambda x: f'{x:.2f}') if eps else 'n/a'} "
                  f"epochs), warmup {cfg['train']['warmup_steps']} steps then cosine to peak/10, "
                  f"p={cfg['model']['window']}; corpus {_corpus_text(s.corpus)}. {len(s.points)} "
                  f"points: {n_div} diverged, {n_spk} spikes. `{_sweep_command(s)}.", "",
                  head, sep]
        for v in s.variants:
            S, best, best_lr = s.sensitivity(v)
            cells = []
            for lr in s.lrs:
                p = s.points.get((v, lr))
                x = s.loss(v, lr)
                txt = ("not run" if p is None else "diverged" if x is None else
                       f"{x:.4f}" + (" (diverged)" if p["diverged"] else ""))
                cells.append(f"**{txt}**" if lr == best_lr else txt)
            lines.append(f"| {v} | " + " | ".join(cells) + f" | {f_lr(best_lr) if best_lr else 'n/a'} | "
                         f"{'n/a' if S is None else f'{S:.3f}'} |")
        low = []
        for lr in s.lrs:
            ok = sorted((s.loss(v, lr), v) for v in s.variants if s.loss(v, lr) is not None)
            low.append("—" if not ok else ok[0][1] + ("" if len(ok) < 2 else f" ({ok[1][0] - ok[0][0]:.3f})"))
        lines += ["| lowest | " + " | ".join(low) + " | | |", "",
                  "Peak max \\|logit\\| of each point:", "",
                  "| variant | " + " | ".join(f_lr(lr) for lr in s.lrs) + " |",
                  "|---|" + "---|" * len(s.lrs)]
        for v in s.variants:
            lines.append(f"| {v} | " + " | ".join(
                f_logit(s.points[(v, lr)].get("peak_max_abs_logit")) if (v, lr) in s.points
                else "not run" for lr in s.lrs) + " |")
        lines += [""] + _plot(root, s, "lr_sweep.png")
    spread = data.seed_spread()
    if spread:
        lines += ["### Seed to seed", "",
                  "| sweeps | variant | lr | loss: one seed / the other | \\|Δ\\| |",
                  "|---|---|---|---|---|"]
        rows = [(d, "") for d in spread["diffs"]] + [(d, " (a seed diverged; not in δ)")
                                                      for d in spread["excluded"]]
        for ((v, lr), x, y, d, a, b), note in sorted(rows, key=lambda r: (r[0][0][0], r[0][0][1])):
            lines.append(f"| {a.label} / {b.label} | {v} | {f_lr(lr)} | {x:.4f} / {y:.4f} | "
                         f"{d:.4f}{note} |")
        lines += ["", f"δ = {spread['delta']:.4f} (the largest \\|Δ\\| of the pairs in which "
                  f"neither seed diverged; mean {spread['mean']:.4f}).", ""]
    return lines


def section_short(data: Data, root: str) -> list[str]:
    if not data.short:
        return []
    lines = ["## Short runs", "",
             "Trained through `ls_jax.training.train` on the library's data pipeline (bytes), evaluated on "
             "the held-out split during training. The max \\|logit\\| is taken at logged steps.", ""]
    for r in data.short:
        c = r.config
        t, d = c["train"], c["data"]
        lines.append(f"- {r.label}: T={d['seq_len']}, batch {t['batch_size']}, lr {f_lr(t['lr'])} "
                     f"(warmup {t['warmup_steps']}, cosine to {f_lr(t['min_lr'])} at step "
                     f"{t['num_steps']:,}), p={c['model']['window']}. `{_short_command(r)}`")
    lines += ["", "| run | variant | steps | final train loss | held-out (step) | max abs logit: "
              "end / peak (step) | top head at end (layer, head) | lm-head max abs logit | spikes "
              "(largest ratio) | diverged (ratio at end) |", "|---|" + "---|" * 9]
    for r in data.short:
        for v, dd in r.variants.items():
            tr, ev = dd["train"], dd["evals"]
            losses = [x["loss"] for x in tr]
            logits = [x["max_abs_logit"] for x in tr]
            k = int(np.argmax(logits))
            table = np.asarray(tr[-1]["attn_max_abs_logit"])
            layer, head = np.unravel_index(int(np.argmax(table)), table.shape)
            n, ratio, _ = spike_of(losses)
            div = rules.divergence(losses)
            diverged = dd["status"].get("state") == "diverged" or rules.blew_up(losses)
            held = "n/a" if not ev else f"{ev[-1]['eval/loss']:.4f} ({ev[-1]['step']:,})"
            lines.append(
                f"| {r.label} | {v} | {tr[-1]['step']:,} | {losses[-1]:.4f} | "
                f"{held} | "
                f"{f_logit(logits[-1])} / {f_logit(logits[k])} ({tr[k]['step']:,}) | "
                f"{f_logit(table[layer, head])} ({layer}, {head}) | "
                f"{f_logit(tr[-1]['lm_head_max_abs_logit'])} | {n} ({ratio:.2f}x) | "
                f"{'yes' if diverged else 'no'} ({div['end_ratio']:.2f}) |")
    lines.append("")
    for r in data.short:
        lines += _plot(root, r, "stability.png")
    return lines


def section_differs(data: Data) -> list[str]:
    def cfgs():
        yield from ((r.config, "batch") for r in data.batch)
        yield from ((s.settings["configs"]["ls"], "sweep") for s in data.sweeps)
        yield from ((r.config, "short") for r in data.short)

    def listed(values) -> str:
        return ", ".join(f"{x:,}" if isinstance(x, int) else str(x) for x in sorted(set(values)))

    corpora = [r.corpus.get("source", "?") for r in data.batch + data.sweeps] + [
        r.config["data"]["source"] for r in data.short]
    at_batch = sorted({(c["train"]["lr"], c["train"]["warmup_steps"]) for c, k in cfgs()
                       if k == "batch"})
    longest = max([v.steps for r in data.batch for v in r.variants.values()], default=0)
    return [
        "## What differs from the paper", "",
        "| | paper | here |", "|---|---|---|",
        "| data | PG-19, SentencePiece 10K | bytes (vocabulary 256) of the machine's files: "
        f"{', '.join(f'`{s}`' for s in sorted(set(corpora)))} |",
        f"| tokens per step | {PAPER_TOKENS_PER_STEP:,} | "
        f"{listed(c['train']['batch_size'] * c['data']['seq_len'] for c, _ in cfgs())} |",
        f"| sequence length | {PAPER_SEQ_LEN:,} | {listed(c['data']['seq_len'] for c, _ in cfgs())} |",
        f"| steps | 50k+ (divergence at {DIVERGE_FROM // 1000}-{DIVERGE_TO // 1000}k) | at most "
        f"{longest:,} at the paper's batch |",
        f"| peak lr, warmup | {f_lr(PAPER_LR)}, {PAPER_WARMUP:,} | "
        + "; ".join(f"{f_lr(lr)}, {w:,}" for lr, w in at_batch) + " at the paper's batch; the "
        "sweeps and short runs above set their own |",
        f"| local window p (keys, the query's own included) | {PAPER_WINDOW} | "
        f"{listed(c['model']['window'] for c, _ in cfgs())} |",
        "| seeds | not stated | see Caveats |",
        "",
    ]


def section_summary(data: Data, claims: list[Claim]) -> list[str]:
    """3-6 sentences for quoting: what was measured, each verdict, the caveat."""
    c = {claim.__name__.removeprefix("claim_"): k for claim, k in zip(CLAIMS, claims)}

    def said(k: str) -> str:
        return c[k].label + (f" ({c[k].detail})" if c[k].detail else "")

    out = []
    mh, ls = data.variants("mhsa"), data.variants("ls")
    if mh and ls:
        out.append(f"At the paper's batch MHSA's largest attention logit reached "
                   f"{f_logit(max(np.nanmax(v.logit) for v in mh))} while LS's stayed at or below "
                   f"{f_logit(max(np.nanmax(v.logit) for v in ls))} for up to "
                   f"{max(v.steps for v in ls):,} steps: {c['logits'].label}.")
    out.append(f"MHSA's loss spikes: {said('spikes')}; LS's loss below MHSA's: {said('loss')}; "
               f"MHSA's divergence after {DIVERGE_FROM // 1000}-{DIVERGE_TO // 1000}k steps: "
               f"{said('divergence')}.")
    out.append(f"LS at 2/5 of QK-norm's perplexity: {said('qknorm')}.")
    out.append(f"LS at z-loss's perplexity with 1/20 of the GPU-hours: {said('zloss')}.")
    out.append(f"A wider range of good peak lrs for LS than for MHSA: {said('sensitivity')}.")
    s = data.seed_spread()
    out.append("Each comparison rests on one seed per run" + (
        ", with no seed spread measured" if s is None else
        f", against a seed spread δ = {s['delta']:.4f} measured on the sweep") +
        ", on byte-level text of the machine's source files rather than PG-19.")
    return ["## Summary", "", " ".join(out), ""]


def readme_block(root: str = RESULTS) -> str:
    """The README's verdict paragraph: the page's summary and a link to the page."""
    data = Data(load(root))
    summary = section_summary(data, [claim(data) for claim in CLAIMS])[2].replace("\\|", "|")
    return (f"**Stability.** {summary} Claim by claim, with the rules, the runs and the caveats: "
            f"[docs/stability.md](docs/stability.md).")


def with_readme_block(readme: str, block: str) -> str:
    start, end = README_MARKERS
    i, j = readme.find(start), readme.find(end)
    if i < 0 or j < i:
        raise ValueError(f"readme: expected the lines {start} and {end} around the verdict")
    return f"{readme[:i + len(start)]}\n{block}\n{readme[j:]}"


def render(root: str = RESULTS) -> str:
    data = Data(load(root))
    claims = [claim(data) for claim in CLAIMS]
    lines = [
        "# Stability: attention logits, loss spikes and divergence, LS against MHSA and its stabilisers",
        "",
        f"Written by `{COMMAND}` from the result files in [stability/](stability/); "
        "`--check` fails, and so does a test, when this page and the files disagree. Every number "
        "is computed from those files; the paper's (arXiv 2505.15548) are the constants of its "
        "claims. Variants: `ls` (LS-attention), `mhsa` (every head global), `mhsa_qknorm` (MHSA "
        "+ LayerNorm on q and k), `mhsa_zloss` (MHSA + z-loss on the LM head's logsumexp): the "
        "configs `paper`, `paper_mhsa`, `paper_qknorm`, `paper_zloss` with byte tokens.",
        "",
        *section_verdict(claims), *section_rules(data), *section_caveats(data),
        *section_runs(data), *section_batch(data, root), *section_sweeps(data, root),
        *section_short(data, root), *section_differs(data), *section_summary(data, claims),
    ]
    text = "\n".join(lines).rstrip("\n") + "\n"
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=RESULTS, help="the folder of result folders")
    parser.add_argument("--page", default=PAGE, help="the page --write and --check read")
    parser.add_argument("--readme", default=README,
                        help="the README whose verdict paragraph --write and --check read")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write the page")
    mode.add_argument("--check", action="store_true", help="exit 1 when the page differs")
    args = parser.parse_args(argv)
    try:
        text = render(args.results)
        readme_old = open(args.readme).read() if (args.write or args.check) else ""
        readme = with_readme_block(readme_old, readme_block(args.results)) if readme_old else ""
    except (ValueError, KeyError, FileNotFoundError, json.JSONDecodeError) as e:
        parser.error(f"results: {e}" if not str(e).startswith("results:") else str(e))
    n = text.count("\n")
    if n > MAX_LINES:
        parser.error(f"page: expected at most {MAX_LINES} lines, got {n}")
    if args.check:
        old = open(args.page).read() if os.path.exists(args.page) else None
        for path, want, have in ((args.page, text, old), (args.readme, readme, readme_old)):
            if have != want:
                print(f"{path} differs from what {args.results} gives; run `{COMMAND}`",
                      file=sys.stderr)
                return 1
        return 0
    if args.write:
        with open(args.page, "w") as f:
            f.write(text)
        with open(args.readme, "w") as f:
            f.write(readme)
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
