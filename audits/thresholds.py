"""What each check of the adapter audit holds its measured value to (`mergekit-lite audit --min-...`)."""

from __future__ import annotations

from dataclasses import dataclass

from mergekit_lite.audits.fingerprint import DEFAULT_TOP_K


@dataclass(frozen=True)
class AuditThresholds:
    """What each check's measured value is held to, and why these defaults.

    min_fingerprint_similarity 0.95: per module, the smaller of the spectrum and probe cosines against
        the fingerprint. The same base scores 1.0 (bf16 copies and light fine-tunes stay above 0.999);
        unrelated weights score ~0 on the probe. 0.95 leaves room for dtype noise only.
    min_alignment 1.5: with no fingerprint, the share of the update's energy inside the base's top left
        singular subspace, over the share a random matrix has there (k/rows), median over modules.
        Unrelated weights give ~1.0 (0.9-1.15 measured on same-recipe tiny bases); updates trained on a
        base that has learned structure reuse its directions (LoRA paper, section 7): 1.7-2.8 measured
        on tiny pretrained Llamas. A randomly initialised base has no such geometry (~1.0 even for its
        own adapters). It only ever warns: a genuine update may live outside the top directions.
    top_k 8: singular directions per matrix (a fingerprint's own top_k wins). The alignment subspace is
        min(top_k, short side / 4), so it never spans more than a quarter of the space.
    min_delta 1e-4: the largest ||dW||_F / ||W||_F over modules below this is a no-op: storing the merge
        in bf16 rounds every weight by ~4e-3 relative, which swallows an update 40x smaller.
    min_total_norm 1.0: the paper's no-op rule (Table 2; calibrated in App. G, where audited Llama-3.1
        adapters measured 1.07-16.6 and the excluded no-op 0.016). An absolute Frobenius norm: it grows
        with model width and the number of adapted modules, so it is the paper's rule for 7-8B models
        and can be lowered (--min-total-norm) for small ones.
    min_kl 1e-3, min_noop_top1 0.95, max_kl 20: the paper's reading of the output divergence (App. I):
        KL below 1e-3 with the greedy token kept on more than 95% of probes is a no-op, KL above 20 nats
        is "likely wrong base".
    max_base_kl 1e-3 (ours): the given base's KL from the fingerprinted base's recorded outputs, held to the
        paper's no-op scale: a base that far from the recorded one is not behaviourally the same. Measured on
        tiny pretrained Llamas: the same weights 3e-8, a bf16 copy 2e-6, a twin pretrained alike from another
        seed 1.8e-2.
    ngram 13, max_contaminated_share 0.01: the usual decontamination n-gram length; more than 1% of the
        holdout seen in training makes scores on it untrustworthy (any contamination warns).
    """

    min_fingerprint_similarity: float = 0.95
    min_alignment: float = 1.5
    top_k: int = DEFAULT_TOP_K
    min_delta: float = 1e-4
    min_total_norm: float = 1.0
    min_kl: float = 1e-3
    min_noop_top1: float = 0.95
    max_kl: float = 20.0
    max_base_kl: float = 1e-3
    ngram: int = 13
    max_contaminated_share: float = 0.01
