"""Write HH-RLHF's SFT, RL and eval sets for train_hh_sft.sh / train_hh_rl.sh, with disjoint SFT and RL prompts.

    python examples/scripts/prepare_hh_data.py --out DATA_DIR/hh [--seed 0]

GeoAlign (arXiv 2606.26917, App. B.1) trains SFT on 144,716 HH-RLHF samples and RL on 17,226 other ones. The text
does not say how the two were drawn, so here: every transcript of Anthropic/hh-rlhf's train split is cut at its last
``"\\n\\nAssistant:"`` into a prompt (HH's own "Human:/Assistant:" text, kept as the RL prompt format and parsed back
into chat turns by the ArmoRM reward) and the chosen response; the distinct prompts are shuffled with ``--seed``; the
first 17,226 are the RL prompts, and the SFT set is the (prompt, chosen) rows whose prompt is not one of them, up to
144,716 rows. The split has 160,800 rows, so the SFT set falls short of 144,716 by about the rows of the RL
prompts; the counts are printed. The test split's distinct prompts are the in-training eval set (the paper's
"proxy reward on the HH-RLHF test set", §5.1).

Writes ``hh_sft.jsonl`` (``prompt``, ``chosen``), ``hh_rl.jsonl`` and ``hh_test.jsonl`` (``prompt``). Needs the
`datasets` library and hub access (run it once; the folder must be visible to the SFT node and every Ray node).
"""

import argparse
import json
import random
import sys
from pathlib import Path

SOURCE = "Anthropic/hh-rlhf"
SFT_SIZE, RL_SIZE = 144_716, 17_226  # GeoAlign App. B.1
ASSISTANT = "\n\nAssistant:"


def split_transcript(text):
    """HH transcript -> (prompt up to and including its last "\\n\\nAssistant:", response); None if it has none."""
    cut = text.rfind(ASSISTANT)
    if cut < 0 or not text[cut + len(ASSISTANT) :].strip():
        return None
    cut += len(ASSISTANT)
    return text[:cut], text[cut:]


def transcripts(records, key="chosen"):
    """(prompt, response) of each record's ``key`` transcript, skipping transcripts without a final answer."""
    return [pair for pair in (split_transcript(r[key]) for r in records) if pair is not None]


def split_disjoint(pairs, rl_size, sft_size, seed):
    """(SFT rows, RL rows): RL = ``rl_size`` distinct prompts drawn with ``seed``; SFT = up to ``sft_size`` of the
    (prompt, response) pairs whose prompt is not an RL prompt, in source order."""
    prompts = list(dict.fromkeys(p for p, _ in pairs))  # distinct, first-seen order
    if len(prompts) < rl_size:
        raise ValueError(f"{len(prompts)} distinct prompts cannot give {rl_size} RL prompts")
    random.Random(seed).shuffle(prompts)
    rl = prompts[:rl_size]
    held_out = set(rl)
    sft = [{"prompt": p, "chosen": r} for p, r in pairs if p not in held_out][:sft_size]
    return sft, [{"prompt": p} for p in rl]


def write_jsonl(rows, path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.rename(path)  # a crashed run never leaves a truncated file the scripts would take as done


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for hh_sft.jsonl, hh_rl.jsonl, hh_test.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="seed of the RL prompt draw")
    parser.add_argument("--sft-size", type=int, default=SFT_SIZE, help="at most this many SFT rows")
    parser.add_argument("--rl-size", type=int, default=RL_SIZE, help="RL prompts")
    args = parser.parse_args(argv)
    if args.sft_size < 1 or args.rl_size < 1:
        parser.error(f"--sft-size and --rl-size must be >= 1 (got {args.sft_size}, {args.rl_size})")
    import datasets

    train = transcripts(datasets.load_dataset(SOURCE, split="train"))
    sft, rl = split_disjoint(train, args.rl_size, args.sft_size, args.seed)
    test = [
        {"prompt": p} for p in dict.fromkeys(p for p, _ in transcripts(datasets.load_dataset(SOURCE, split="test")))
    ]
    out = Path(args.out)
    for name, rows in (("hh_sft", sft), ("hh_rl", rl), ("hh_test", test)):
        write_jsonl(rows, out / f"{name}.jsonl")
        print(f"{name}: {len(rows)} rows -> {out / f'{name}.jsonl'}")
    if len(sft) < args.sft_size:
        print(f"note: {SOURCE} train has {len(train)} usable rows; the SFT set has {len(sft)} < {args.sft_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
