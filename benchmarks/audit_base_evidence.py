"""What tells a LoRA adapter made on this base from one made on another base, without a declared base or fingerprint?

    PYTHONPATH=$PWD .venv/bin/python benchmarks/audit_base_evidence.py            # a few minutes on 2 cores

For each architecture (tiny llama, qwen2, gpt2), three bases: `base` and `other` pretrained alike on the same
Markov-chain text from different seeds, and `variant` = base plus a short full fine-tune on another chain (a close
variant). Real PEFT LoRA adapters are trained on each of them (ranks 4 and 16, 15 and 60 Adam steps, two task
chains), then each is applied to `base`, the base the audit is given, and measured:

- corr (Hu et al. 2021, sec. 7.3): ||U^T W V||_F for U, V the top-r singular vectors of dW, over its expectation for
  random r-dimensional subspaces (||W||_F r / sqrt(m n)); median over modules. The paper finds dW correlates with W.
- top-subspace (the audit's spectral alignment): share of dW's energy in W's top-k left singular subspace over k/m.
- B-activations: share of lora_B's column energy in the top-k principal subspace of the base module's outputs on
  typical texts, over k/out; median over modules.
- loss-typical: loss on typical texts (held-out samples of the pretraining chain) with the adapter minus without.
- loss-task: loss on the adapter's own task texts (what it would ship as eval data) with minus without.

Separation: ROC AUC of "made on base" (positive) against "made on other" and against "made on variant", with the
statistic oriented so that larger means "this base" (1.0: a threshold separates them; 0.5: chance), and the share of
real adapters a threshold rejects when it is set to reject every adapter made on another base. Writes
benchmarks/work/audit-evidence/ (git-ignored; bases and adapters already there are reused: delete it after changing
--pretrain-steps) and prints the Markdown table for RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

VOCAB, HIDDEN, LAYERS, LENGTH = 128, 64, 2, 24
OUT = Path(__file__).resolve().parent / "work" / "audit-evidence"
ARCHITECTURES = {  # class, config, LoRA targets
    "llama": (
        "LlamaForCausalLM",
        lambda: transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=LENGTH,
            tie_word_embeddings=False,
        ),
        ["q_proj", "v_proj", "up_proj", "down_proj"],
    ),
    "qwen2": (
        "Qwen2ForCausalLM",
        lambda: transformers.Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=LENGTH,
            tie_word_embeddings=True,
        ),
        ["q_proj", "v_proj", "up_proj", "down_proj"],
    ),
    "gpt2": (
        "GPT2LMHeadModel",
        lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=LENGTH),
        ["c_attn", "c_fc"],
    ),
}
STATISTICS = ("corr", "top-subspace", "B-activations", "loss-typical", "loss-task")
LOWER_MEANS_THIS_BASE = {"loss-typical", "loss-task"}


def markov_batches(chain_seed: int, sample_seed: int, count: int, batch: int = 16):
    """Batches from a fixed sparse Markov chain (3 successors per token): text a tiny model learns in a few steps."""
    successors = torch.randint(0, VOCAB, (VOCAB, 3), generator=torch.Generator().manual_seed(chain_seed))
    generator = torch.Generator().manual_seed(sample_seed)
    for _ in range(count):
        tokens = torch.zeros(batch, LENGTH, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (batch,), generator=generator)
        for position in range(1, LENGTH):
            tokens[:, position] = successors[
                tokens[:, position - 1], torch.randint(0, 3, (batch,), generator=generator)
            ]
        yield tokens


def fit(model, batches, learning_rate: float) -> None:
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=learning_rate)
    model.train()
    for tokens in batches:
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def build_bases(architecture: str, folder: Path, pretrain_steps: int) -> dict[str, Path]:
    """base and other (same text, other init seed), variant (base + a short fine-tune on another chain)."""
    class_name, make_config, _ = ARCHITECTURES[architecture]
    if all(
        (folder / name / "config.json").is_file() for name in ("base", "other", "variant")
    ):  # an earlier run's bases
        return {name: folder / name for name in ("base", "other", "variant")}
    paths = {}
    for name, seed in (("base", 0), ("other", 1)):
        torch.manual_seed(seed)
        model = getattr(transformers, class_name)(make_config())
        fit(model, markov_batches(100, 1000 + seed, pretrain_steps), 3e-3)
        model.save_pretrained(folder / name)
        paths[name] = folder / name
    model = getattr(transformers, class_name).from_pretrained(paths["base"])
    fit(model, markov_batches(300, 3000, max(pretrain_steps // 10, 5)), 1e-3)
    model.save_pretrained(folder / "variant")
    paths["variant"] = folder / "variant"
    return paths


def train_adapter(architecture: str, made_on: Path, out: Path, rank: int, steps: int, task: int) -> Path:
    class_name, _, targets = ARCHITECTURES[architecture]
    if (out / "adapter_config.json").is_file():  # trained by an earlier, interrupted run of the same settings
        return out
    torch.manual_seed(task)
    model = get_peft_model(
        getattr(transformers, class_name).from_pretrained(made_on),
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, fan_in_fan_out=architecture == "gpt2"),
    )
    fit(model, markov_batches(200 + task, 2000 + task, steps), 3e-3)
    model.save_pretrained(out)
    return out


@torch.no_grad()
def mean_loss(model, batches) -> float:
    return statistics.fmean(float(model(input_ids=tokens, labels=tokens).loss) for tokens in batches)


def subspace_share(vectors: torch.Tensor, basis: torch.Tensor) -> float:
    """Share of the columns' energy inside the span of `basis` (orthonormal columns)."""
    return float((basis.T @ vectors).square().sum() / vectors.square().sum().clamp_min(1e-30))


@torch.no_grad()
def measure(architecture: str, base_dir: Path, adapter_dir: Path, task: int, top_k: int = 8) -> dict[str, float]:
    """Every candidate statistic of one adapter applied to the given base."""
    class_name = ARCHITECTURES[architecture][0]
    base = getattr(transformers, class_name).from_pretrained(base_dir).eval()
    typical = list(markov_batches(100, 9000, 4))
    task_texts = list(markov_batches(200 + task, 9100 + task, 4))
    loss_typical, loss_task = mean_loss(base, typical), mean_loss(base, task_texts)
    base_state = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    outputs = {}  # base module outputs on typical texts, for the B alignment

    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    hooks = []
    for name, module in model.named_modules():
        if hasattr(module, "lora_B") and "default" in getattr(module, "lora_B", {}):
            hooks.append(
                module.base_layer.register_forward_hook(
                    lambda _module, _inputs, output, name=name: outputs.setdefault(name, []).append(
                        output.reshape(-1, output.shape[-1])
                    )
                )
            )
    with model.disable_adapter():
        model(input_ids=typical[0])
    for hook in hooks:
        hook.remove()
    with_typical, with_task = mean_loss(model, typical), mean_loss(model, task_texts)

    corr, top, b_align = [], [], []
    for name, module in model.named_modules():
        if name not in outputs:
            continue
        lora_b = module.lora_B["default"].weight.float()  # [out, r]
        lora_a = module.lora_A["default"].weight.float()  # [r, in]
        delta = module.scaling["default"] * (lora_b @ lora_a)  # [out, in] as PEFT's Linear sees it
        weight = module.base_layer.weight.float()
        weight = weight.T if weight.shape != delta.shape else weight  # Conv1D stores [in, out]
        rank = lora_a.shape[0]
        u, _, vh = torch.linalg.svd(delta, full_matrices=False)
        projected = float((u[:, :rank].T @ weight @ vh[:rank].T).norm())
        random = float(weight.norm()) * rank / (weight.shape[0] * weight.shape[1]) ** 0.5
        corr.append(projected / random)
        left = torch.linalg.svd(weight, full_matrices=False)[0]
        k = max(1, min(top_k, min(weight.shape) // 4))
        top.append(subspace_share(delta, left[:, :k]) / (k / weight.shape[0]))
        activations = torch.cat(outputs[name]).float()
        activations = activations - activations.mean(0)
        principal = torch.linalg.svd(activations, full_matrices=False)[2][:k].T  # [out, k]
        b_align.append(subspace_share(lora_b, principal) / (k / lora_b.shape[0]))
    del base_state
    return {
        "corr": statistics.median(corr),
        "top-subspace": statistics.median(top),
        "B-activations": statistics.median(b_align),
        "loss-typical": with_typical - loss_typical,
        "loss-task": with_task - loss_task,
    }


def roc_auc(positives: list[float], negatives: list[float]) -> float:
    """P(a positive scores above a negative), ties counting half (Mann-Whitney U / n_pos n_neg)."""
    wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def false_rejects(positives: list[float], negatives: list[float]) -> float:
    """Share of real adapters rejected by the threshold that rejects every negative (accept only above max)."""
    cut = max(negatives)
    return sum(p <= cut for p in positives) / len(positives)


def oriented(rows: list[dict], statistic: str) -> dict[str, list[float]]:
    sign = -1.0 if statistic in LOWER_MEANS_THIS_BASE else 1.0
    by_source = {}
    for row in rows:
        by_source.setdefault(row["made_on"], []).append(sign * row[statistic])
    return by_source


def table(rows: list[dict]) -> str:
    lines = [
        "| statistic | architecture | AUC vs other base | false rejects at 0 false accepts (other) | "
        "AUC vs close variant | false rejects (variant) |",
        "|---|---|---|---|---|---|",
    ]
    for statistic in STATISTICS:
        for architecture in [*dict.fromkeys(row["architecture"] for row in rows), "all"]:
            chosen = [row for row in rows if architecture in ("all", row["architecture"])]
            values = oriented(chosen, statistic)
            cells = []
            for negative in ("other", "variant"):
                cells += [
                    f"{roc_auc(values['base'], values[negative]):.2f}",
                    f"{false_rejects(values['base'], values[negative]):.0%}",
                ]
            lines.append(f"| {statistic} | {architecture} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pretrain-steps", type=int, default=150)
    parser.add_argument("--ranks", default="4,16")
    parser.add_argument("--steps", default="15,60")
    parser.add_argument("--tasks", default="1,2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--architectures", default=",".join(ARCHITECTURES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    rows = []
    for architecture in args.architectures.split(","):
        folder = OUT / architecture
        bases = build_bases(architecture, folder, args.pretrain_steps)
        for made_on in ("base", "other", "variant"):
            for rank in map(int, args.ranks.split(",")):
                for steps in map(int, args.steps.split(",")):
                    for task in map(int, args.tasks.split(",")):
                        adapter = train_adapter(
                            architecture,
                            bases[made_on],
                            folder / "adapters" / f"{made_on}-r{rank}-s{steps}-t{task}",
                            rank,
                            steps,
                            task,
                        )
                        rows.append(
                            {
                                "architecture": architecture,
                                "made_on": made_on,
                                "rank": rank,
                                "steps": steps,
                                "task": task,
                                **measure(architecture, bases["base"], adapter, task),
                            }
                        )
                        print(json.dumps(rows[-1]), flush=True)
        print(f"{architecture}: done at {time.perf_counter() - started:.0f} s", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(
        json.dumps({"args": vars(args), "rows": rows, "seconds": time.perf_counter() - started}, indent=1)
    )
    print(f"{len(rows)} adapters in {time.perf_counter() - started:.0f} s\n")
    print(table(rows))


if __name__ == "__main__":
    main()
