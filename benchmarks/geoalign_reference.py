"""One GeoAlign curation step next to its authors' released filter (SYSUzhouting/Trinity-RFT, branch my-geoalign,
9cecab1): time and peak memory, side by side on the same batch.

Nothing of theirs is in this repository: --geoalign-repo (or $OPENRLHF_GEO_GEOALIGN_REPO) is a local checkout; its
trinity/buffer/operators/filters/ (outlier_reward_filter.py, utils.py, outlier_reward_filter_train_subprocess.py) is
loaded by path. Their filter runs inside Trinity-RFT; what this script stands in for, and nothing else:
  - the Trinity modules it imports (`trinity.buffer.operators`: a registry decorator and the ExperienceOperator
    base class; `trinity.common.experience`: Experience, group_by, unused): empty stand-ins;
  - `sklearn.preprocessing` (StandardScaler, normalize: imported, never called): an empty stand-in;
  - Experience objects: plain objects with the attributes the filter reads (prompt_text in Qwen's chat format,
    response_text, reward, policy_last_tokens_hidden, eid.uid);
  - the projector's training: their process() writes the batch's pairs to disk with a run_train.sh and a signal file,
    then polls every 5 s (60 s timeout) for a watcher, not in the repository, to run that script; here the poll
    runs their train_standalone(args) in this process with the script's arguments, and their hard-coded log file
    (/home/daoyuan_dj/...) goes to a temp file. Not counted for them: a Python + torch start-up of the subprocess
    and up to 5 s of polling, which a real run pays.
Their settings are the filter's defaults (projector d -> d/2 -> 512, Adam 1e-4, 50-100 epochs with early stop at
0.85 test accuracy, batch 1024 pairs, outlier_rank_ratio 0.2, peak_pdf_alpha 0.05) with reward_reshape_type
max_random (Best-Random, as Eq. 8 and our default mode replace) and rollout_num = the group size; ours are
GeoAlignConfig()'s defaults (the "math" preset: 2048/d -> 512 -> 512 -> 128, 50 Adam steps of 1024 pairs, cosine
LR from 1e-3, early stop at 0.95, the paper's pointwise KDE rule).
Timed: their whole process(exps) call (pandas, pickle, training, detection, KDE, replacement copies) and our whole
curate(hidden, rewards, prompt ids) call, alternating, each with the same torch seed. Peak memory: the process's
peak RSS above the baseline (VmHWM, reset through /proc/self/clear_refs) with glibc mmap-ing every allocation of
64 KiB or more, measured in one more, untimed, pass; on CUDA torch.cuda.max_memory_allocated.

Batches: "synthetic" = benchmarks/geoalign_speed.py's planted batch (prompt base + 1[correct] e + noise, 10 % of
binary rewards flipped) at --prompts x --group, d = --dim; "smollm2" = the real LM's last-response-token hidden
states (d = 576) of its sampled responses to the lab's word problems (benchmarks/salt_peer_cost.py's rollouts; a
.pt cache with --rollouts), with seeded 0/1 rewards.

--their-epochs N runs their training for exactly N epochs and projects their step to their 50 (early stop) and 100
(no early stop) epochs: the rest of the step plus N-epoch training time x 50 / N (x 100 / N), a projection, not a
measurement (their epochs are alike: the same pairs, batches of 1024, a test pass each).

Usage: python benchmarks/geoalign_reference.py [--geoalign-repo DIR] [--batches synthetic smollm2] [--prompts 96]
       [--group 16] [--dim 2048] [--reps 1] [--their-epochs N] [--threads 2] [--device cpu|cuda] [--rollouts FILE]
"""

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from types import SimpleNamespace

import torch

from openrlhf_geo.geoalign import GeoAlignConfig, curate

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from geoalign_speed import planted  # noqa: E402
from salt_peer_cost import GIB, Meter, exact_rss_peaks, smollm2_rollouts  # noqa: E402

FILTERS = Path("trinity", "buffer", "operators", "filters")
HARD_CODED_LOG = "/home/daoyuan_dj/zt_RLHF_RM_Refine/log.txt"


def stand_in(name: str, **attributes):
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def load_theirs(repo: Path, log: Path):
    """(the filter module, the training subprocess module), loaded from the checkout with the stand-ins above."""
    folder = repo / FILTERS
    if not (folder / "outlier_reward_filter.py").is_file():
        raise SystemExit(f"geoalign_reference: {folder / 'outlier_reward_filter.py'} not found: --geoalign-repo must "
                         "be a checkout of SYSUzhouting/Trinity-RFT at 9cecab1 (branch my-geoalign)")  # fmt: skip
    registry = SimpleNamespace(register_module=lambda name: lambda cls: cls)
    for name in ("trinity", "trinity.buffer", "trinity.common", "sklearn"):
        stand_in(name, __path__=[])
    stand_in("trinity.buffer.operators", __path__=[], EXPERIENCE_OPERATORS=registry, ExperienceOperator=object)
    stand_in("trinity.common.experience", Experience=object, group_by=None)
    stand_in("sklearn.preprocessing", StandardScaler=None, normalize=None)
    package = stand_in("trinity.buffer.operators.filters", __path__=[str(folder)])
    modules = {}
    for name in ("utils", "outlier_reward_filter"):
        spec = importlib.util.spec_from_file_location(f"{package.__name__}.{name}", folder / f"{name}.py")
        modules[name] = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = modules[name]
        spec.loader.exec_module(modules[name])
    # the training script imports `utils` as a top-level module and chdirs to the filters folder from the repo root
    sys.modules["utils"] = modules["utils"]
    cwd = os.getcwd()
    try:
        os.chdir(repo)
        path = folder / "outlier_reward_filter_train_subprocess.py"
        spec = importlib.util.spec_from_file_location("geoalign_reference_train", path)
        train = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(train)
    finally:
        os.chdir(cwd)
        del sys.modules["utils"]
        sys.path.remove("./trinity/buffer/operators/filters")  # the script's own (relative) entry

    def redirected_open(path, *args, **kwargs):
        return open(log if str(path) == HARD_CODED_LOG else path, *args, **kwargs)

    train.open = redirected_open  # module globals come before builtins
    return modules["outlier_reward_filter"], train


def theirs_filter(module, train, dim, group, workdir: Path, trained: list, epochs=None):
    """Their OutlierRewardFilter with its defaults, whose wait for the watcher runs the training script in place."""
    flt = module.OutlierRewardFilter(input_hidden_state_dim=dim, rollout_num=group, reward_reshape_type="max_random",
                                     classifier_model_save_path=str(workdir))  # fmt: skip
    session = {}

    def write_signal_then_train(done_path, timeout=60, interval=5):
        start = time.perf_counter()
        args = SimpleNamespace(model_save_path=os.path.dirname(done_path), output_hidden_dim=flt.output_hidden_dim,
                               min_epochs=epochs or flt.classifier_train_min_epochs,
                               max_epochs=epochs or flt.classifier_train_max_epochs,
                               early_stop_acc=flt.classifier_train_early_stop_acc, batch_size=1024,
                               learning_rate=flt.classifier_update_lr, test_split=0.1)  # fmt: skip
        train.train_standalone(args)
        session["train_s"] = time.perf_counter() - start
        trained.append(session["train_s"])

    module.wait_for_file = write_signal_then_train
    return flt


def experiences(hidden, rewards, group_ids):
    return [
        SimpleNamespace(
            prompt_text=f"<|im_start|>user\nprompt {int(p)}<|im_end|>\n<|im_start|>assistant\n",
            response_text=f"response {i}",
            reward=float(r),
            policy_last_tokens_hidden=[h.clone()],
            eid=SimpleNamespace(uid=f"{int(p)}-{i}"),
        )  # fmt: skip
        for i, (h, r, p) in enumerate(zip(hidden, rewards, group_ids))
    ]


def batches(args):
    """{name: (hidden (N, d), rewards (N,), prompt ids (N,), group size)}."""
    out = {}
    for name in args.batches:
        if name == "synthetic":
            hidden, rewards, ids, _ = planted(args.prompts, args.group, args.dim, 0.1, seed=0)
            out[f"synthetic {args.prompts}x{args.group}, d={args.dim}"] = (hidden.float(), rewards, ids, args.group)
        else:
            rollouts = smollm2_rollouts(args.real_prompts, args.real_group, 32, cache=args.rollouts)
            ids = rollouts["group_ids"]
            group = int((ids == ids[0]).sum())
            rewards = torch.randint(0, 2, (len(ids),), generator=torch.Generator().manual_seed(0)).double()
            label = f"smollm2 {len(ids) // group}x{group}, d={rollouts['last_hidden'].shape[1]}"
            out[label] = (rollouts["last_hidden"].float(), rewards, ids, group)
    return out


def run_theirs(flt, hidden, rewards, ids, device):
    exps = experiences(hidden, rewards, ids)
    torch.manual_seed(0)
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        with Meter(device) as meter:
            kept, stats = flt.process(exps)
    replaced = stats.get("replaced_count", stats.get("filtered_count", 0))
    return meter, f"{replaced} replaced"


def run_ours(hidden, rewards, ids, device):
    config = GeoAlignConfig(device=str(device))
    torch.manual_seed(0)
    with Meter(device) as meter:
        _, stats = curate(hidden, rewards, ids, config, torch.Generator().manual_seed(0))
    return meter, f"{stats.get('n_flagged', float('nan')):.0f} flagged, {stats.get('proj_steps', 0):.0f} steps"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--geoalign-repo", type=Path, default=os.environ.get("OPENRLHF_GEO_GEOALIGN_REPO"),
                        help="checkout of SYSUzhouting/Trinity-RFT at 9cecab1 (default: that variable)")  # fmt: skip
    parser.add_argument("--batches", nargs="+", default=["synthetic", "smollm2"], choices=["synthetic", "smollm2"])
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--real-prompts", type=int, default=32, help="smollm2: prompts (without --rollouts)")
    parser.add_argument("--real-group", type=int, default=8, help="smollm2: responses per prompt")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--their-epochs", type=int, default=None,
                        help="their training for exactly N epochs (default: theirs, 50-100), the step projected "
                        "to 50 and 100 epochs (where the machine cannot run theirs whole)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rollouts", type=Path, default=None, help="cache of the real LM's rollouts (.pt)")
    args = parser.parse_args(argv)
    if args.geoalign_repo is None:
        parser.error("--geoalign-repo (or $OPENRLHF_GEO_GEOALIGN_REPO): a checkout of SYSUzhouting/Trinity-RFT")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print("# GeoAlign step: theirs (OutlierRewardFilter.process) vs ours (geoalign.curate)")
    load = os.getloadavg()[0]
    print(f"device {device}, {args.threads} threads, reps {args.reps}, load average {load:.2f} at the start")
    with tempfile.TemporaryDirectory(prefix="geoalign_reference_") as tmp:
        module, train = load_theirs(args.geoalign_repo.resolve(), Path(tmp, "log.txt"))
        print("\n## side by side")
        print("| batch | side | step s min (median) | of it, their training s | peak GiB | outcome | "
              "time theirs / ours | peak theirs / ours |")  # fmt: skip
        print("|" + "---|" * 8)
        for label, (hidden, rewards, ids, group) in batches(args).items():
            trained, times, peaks, outcome = [], {"theirs": [], "ours": []}, {}, {}
            hidden = hidden.to(device)
            for rep in range(args.reps + (device.type == "cpu")):
                memory_pass = rep == args.reps
                if memory_pass:
                    exact_rss_peaks()
                for side in ("theirs", "ours")[:: 1 if rep % 2 == 0 else -1]:
                    if side == "theirs":
                        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):  # its prints
                            flt = theirs_filter(module, train, hidden.shape[1], group, Path(tmp), trained,
                                                args.their_epochs)  # fmt: skip
                        meter, outcome[side] = run_theirs(flt, hidden.cpu(), rewards, ids, device)
                    else:
                        meter, outcome[side] = run_ours(hidden, rewards, ids, device)
                    if not memory_pass:
                        times[side].append(meter.seconds)
                    peaks[side] = meter.peak
            per_rep = [t / o for t, o in zip(times["theirs"], times["ours"])]
            for side in ("theirs", "ours"):
                cells = [f"{min(times[side]):.2f} ({statistics.median(times[side]):.2f})",
                         f"{min(trained[: args.reps]):.2f}" if side == "theirs" else "",
                         f"{peaks[side] / GIB:.3f}", outcome[side]]  # fmt: skip
                if side == "theirs":
                    cells += [f"{statistics.median(per_rep):.2f}x ({min(per_rep):.2f}-{max(per_rep):.2f})",
                              f"{peaks['theirs'] / max(peaks['ours'], 1):.2f}x"]  # fmt: skip
                else:
                    cells += ["", ""]
                print(f"| {label} | {side} | " + " | ".join(cells) + " |")
            if args.their_epochs:
                rest = [t - e for t, e in zip(times["theirs"], trained)]
                for epochs in (50, 100):
                    projected = [r + e * epochs / args.their_epochs for r, e in zip(rest, trained)]
                    ratios = [p / o for p, o in zip(projected, times["ours"])]
                    print(f"their step projected to {epochs} epochs (from {args.their_epochs}): "
                          f"{min(projected):.1f} s, theirs / ours {statistics.median(ratios):.1f}x")  # fmt: skip
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
