"""SALT against its nulls on demo-like rollouts: a Table 9/10-style table (arXiv 2606.05800 App. F.3.2, F.5).

Rollouts: the local demo's task (two-digit additions with a carry, `openrlhf_geo.lab.task`) and its tiny Qwen2
(2 layers × 64, V = 28), warmed up in-process by the demo's SFT recipe (its 600 steps unless --sft-steps; or loaded
from --model, e.g. the demo's cached runs/demo/sft); --batches batches of --prompts training prompts × --samples
sampled responses (the demo's 8 × 16 = 128 rollouts, temperature 1, at most 48 new tokens); reward 1 when the last
\\boxed{} holds the sum, else 0; GRPO advantages (Eq. 2 within each prompt's group, sample std + 1e-6, 0 for a
group of equal rewards); exact LM-head-gradient features (Eq. 19, features.lm_head_features, D = V·d = 1792).

Per batch, on the same a, K and α_t: the backbone's coefficients a, SALT's a' and three nulls — rand-proj
(Table 9's RandSubspace-SALT), permuted (Permuted-SALT), matched-rand-subspace (Matched-RandSubspace), each over
--draws generator seeds — and, as a reading check, Matched-RandSubspace with the other score the text allows
(samples ranked by the rand-proj coefficients instead of the random residual of [a]₊). Columns: D_a, D_g (Eq. 59),
n_eff of the applied coefficients (Eq. 60) and U⊥ gain = U⊥(a')/U⊥(a) (Eq. 61, Table 10), mean ± sd over batches
(each batch the mean over its draws), next to the paper's GRPO rows (Table 9; SALT and backbone also Table 10).

Usage: python benchmarks/salt_nulls.py [--sft-steps 600] [--batches 8] [--draws 8] [--model DIR] [--threads 1]
"""

import argparse
import random
import re
import statistics
import time

import torch

from openrlhf_geo import diagnostics
from openrlhf_geo.features import lm_head_features
from openrlhf_geo.lab import task
from openrlhf_geo.salt import salt_advantages

MAX_NEW_TOKENS = 48  # the demo's: the longest worked solution is 40 tokens + EOS
# The demo's SFT recipe (openrlhf_geo.lab.recipe.SFT; strategies ["digits"], cosine decay to 0.05, seed 0).
SFT = {"hidden_size": 64, "num_layers": 2, "lr": 3e-3, "batch_size": 128, "per_prompt": 8, "shortcut_rate": 0.5}
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
# arXiv 2606.05800 Table 9 (GRPO rows; DeepSeek-Distill-Qwen-7B / MATH-TRAIN): D_a, D_g, n_eff, U⊥ gain.
PAPER = {
    "Backbone (GRPO a)": ("0.000", "0.000", "0.31 ± 0.05", "1.00×"),
    "RandSubspace-SALT (rand-proj)": ("0.22 ± 0.04", "0.18 ± 0.03", "0.50 ± 0.05", "1.13×"),
    "Permuted-SALT (permuted)": ("0.24 ± 0.04", "0.19 ± 0.03", "0.43 ± 0.05", "1.08×"),
    "Matched-RandSubspace (matched-rand-subspace)": ("0.24 ± 0.04", "0.18 ± 0.03", "0.55 ± 0.04", "1.18×"),
    "Matched-RandSubspace, score = rand-proj a'": ("", "", "", ""),
    "+ SALT (full)": ("0.24 ± 0.04", "0.16 ± 0.03", "0.80 ± 0.04", "1.47×"),
}
METRICS = ("D_a", "D_g", "n_eff_out", "U_perp_gain")


def warmed_up_model(steps, model_dir):
    tokenizer = task.build_tokenizer()
    if model_dir:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), tokenizer
    model = task.build_model(tokenizer, SFT["hidden_size"], SFT["num_layers"], seed=0)
    problems = task.addition_problems(3000, seed=0, carry_only=True)
    rows = task.sft_rows(problems, SFT["per_prompt"], 0, ["digits"], SFT["shortcut_rate"])
    task.sft(model, tokenizer, rows, steps, SFT["batch_size"], SFT["lr"], seed=0, final_lr_ratio=0.05)
    return model.eval(), tokenizer


@torch.no_grad()
def sampled_rollouts(model, tokenizer, problems, samples, seed):
    """len(problems) prompts × samples responses and one forward over them: (advantages (m,) float64, rewards (m,),
    response tokens, their mask, and the logits and lm_head inputs that produced them, each (m, T, ·))."""
    torch.manual_seed(seed)
    enc = tokenizer([p["prompt"] for p in problems], return_tensors="pt", padding=True, padding_side="left")
    ids = enc["input_ids"].repeat_interleave(samples, 0)
    prompt_mask = enc["attention_mask"].repeat_interleave(samples, 0)
    eos = tokenizer.eos_token_id
    sequences = model.generate(
        input_ids=ids,
        attention_mask=prompt_mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=MAX_NEW_TOKENS,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
    )
    width = ids.shape[1]
    tokens = sequences[:, width:]
    ended = (tokens == eos).long().cumsum(1)
    mask = (ended == 0) | ((ended == 1) & (tokens == eos))  # the response up to and including its EOS
    attention = torch.cat([prompt_mask, mask.long()], dim=1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    captured = {}
    hook = model.lm_head.register_forward_hook(lambda _m, inputs, _o: captured.update(hidden=inputs[0]))
    try:
        logits = model(input_ids=sequences, attention_mask=attention, position_ids=positions).logits
    finally:
        hook.remove()
    texts = tokenizer.batch_decode(tokens.masked_fill(~mask, tokenizer.pad_token_id), skip_special_tokens=True)
    answers = [p["answer"] for p in problems for _ in range(samples)]
    rewards = torch.tensor([float((BOXED.findall(t) or [None])[-1] == ans) for t, ans in zip(texts, answers)])
    r = rewards.double().reshape(len(problems), samples)
    std = r.std(1, keepdim=True)
    advantages = torch.where(std > 0, (r - r.mean(1, keepdim=True)) / (std + 1e-6), 0.0).reshape(-1)
    # logits/hidden at position t produce token t + 1
    return advantages, rewards, tokens, mask, logits[:, width - 1 : -1], captured["hidden"][:, width - 1 : -1]


def rollout_batch(model, tokenizer, problems, samples, seed):
    """(advantages (m,) float64, exact features (m, V·d), rewards (m,)) for len(problems) prompts × samples."""
    advantages, rewards, tokens, mask, logits, hidden = sampled_rollouts(model, tokenizer, problems, samples, seed)
    return advantages, lm_head_features(logits, hidden, tokens, mask, method="exact"), rewards


def matched_by_rand_proj_order(salt_values, rand_proj_values):
    """The sorted a'_SALT values assigned in the order of the rand-proj coefficients (largest to largest)."""
    out = torch.empty_like(salt_values)
    out[torch.argsort(rand_proj_values, descending=True, stable=True)] = torch.sort(
        salt_values, descending=True
    ).values
    return out


def batch_rows(a, F, draws):
    """{row name: {metric: value}} and SALT's PR, k_t, α_t for one batch; the nulls averaged over `draws` seeds."""
    salt, stats, (basis, is_top, _) = salt_advantages(a, F, return_basis=True)
    K = diagnostics.gram(F)
    u_in = diagnostics.residual_strength(a, K, basis, is_top)

    def measured(values):  # SALT's own stats (Eq. 59-61 on its K and P_k) for coefficients SALT did not return
        return {
            "D_a": diagnostics.coefficient_change(a, values),
            "D_g": diagnostics.update_change(a, values, K),
            "n_eff_out": diagnostics.effective_sample_size(values, K),
            "U_perp_gain": diagnostics.residual_strength(values, K, basis, is_top) / u_in,
        }

    alt_name = "Matched-RandSubspace, score = rand-proj a'"
    names = {
        "rand-proj": "RandSubspace-SALT (rand-proj)",
        "permuted": "Permuted-SALT (permuted)",
        "matched-rand-subspace": "Matched-RandSubspace (matched-rand-subspace)",
    }
    per_draw = {name: [] for name in (*names.values(), alt_name)}
    for seed in range(draws):
        for variant, name in names.items():
            out, null = salt_advantages(a, F, variant, generator=torch.Generator().manual_seed(seed))
            assert null["alpha"] == stats["alpha"]  # the nulls keep the step's α_t
            per_draw[name].append(null)
            if variant == "rand-proj":
                per_draw[alt_name].append(measured(matched_by_rand_proj_order(salt, out)))
    rows = {"Backbone (GRPO a)": measured(a), "+ SALT (full)": {key: stats[key] for key in METRICS}}
    for name, draws_stats in per_draw.items():
        rows[name] = {key: statistics.mean(s[key] for s in draws_stats) for key in METRICS}
    return rows, {key: stats[key] for key in ("pr", "k", "alpha")}


def fmt(values, gain=False):
    mean, sd = statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.2f}× ± {sd:.2f}" if gain else f"{mean:.3f} ± {sd:.3f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sft-steps", type=int, default=600, help="in-process SFT warm-up steps (the demo's: 600)")
    p.add_argument("--model", default=None, help="a saved model directory instead of the warm-up (runs/demo/sft)")
    p.add_argument("--batches", type=int, default=8, help="rollout batches (one SALT partition each)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch (the demo: 8)")
    p.add_argument("--samples", type=int, default=16, help="responses per prompt (the demo: 16)")
    p.add_argument("--draws", type=int, default=8, help="generator seeds per null and batch")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, tokenizer = warmed_up_model(args.sft_steps, args.model)
    warm = time.perf_counter() - start
    problems = task.addition_problems(3000, seed=0, carry_only=True)
    table, contexts, rewards_all, live = {}, [], [], []
    for b in range(args.batches):
        picked = random.Random(b).sample(problems, args.prompts)
        a, F, rewards = rollout_batch(model, tokenizer, picked, args.samples, seed=b)
        rewards_all.append(float(rewards.mean()))
        live.append(float((a.reshape(args.prompts, -1).abs().sum(1) > 0).double().mean()))
        if not a.any():
            print(f"batch {b}: every group has equal rewards (a = 0), skipped")
            continue
        rows, context = batch_rows(a, F, args.draws)
        contexts.append(context)
        for name, values in rows.items():
            for key, value in values.items():
                table.setdefault(name, {}).setdefault(key, []).append(value)
    total = time.perf_counter() - start
    source = f"loaded {args.model}" if args.model else f"{args.sft_steps} SFT steps"
    print(
        f"{len(contexts)} batches of m = {args.prompts} x {args.samples} rollouts (exact features, D = {F.shape[1]}); "
        f"warm-up {warm:.0f} s ({source}), total {total:.0f} s"
    )
    print(
        f"reward rate {statistics.mean(rewards_all):.2f}, groups with mixed rewards {statistics.mean(live):.2f}, "
        f"PR {statistics.mean(c['pr'] for c in contexts):.1f}, k_t {statistics.mean(c['k'] for c in contexts):.1f}, "
        f"alpha_t {statistics.mean(c['alpha'] for c in contexts):.2f}"
    )
    header = "| method | D_a | D_g | n_eff | U⊥ gain | paper D_a | paper D_g | paper n_eff | paper U⊥ gain |"
    print(header)
    print("|" + "---|" * header.count(" | ") + "---|")
    for name, paper in PAPER.items():
        ours = table[name]
        cells = [fmt(ours["D_a"]), fmt(ours["D_g"]), fmt(ours["n_eff_out"]), fmt(ours["U_perp_gain"], gain=True)]
        print(f"| {name} | " + " | ".join(cells + list(paper)) + " |")


if __name__ == "__main__":
    main()
