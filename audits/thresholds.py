"""What each check of the adapter audit holds its measured value to, declared once for the Python API and
`mergekit-lite audit --min-...` (whose options are made from the model: cli/options.py)."""

from __future__ import annotations

from mergekit_lite.settings import Settings, setting

DEFAULT_TOP_K = 8  # singular directions per matrix a fingerprint keeps


class AuditThresholds(Settings):
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

    min_fingerprint_similarity: float = setting(
        0.95,
        "Reject when any module's similarity to the base fingerprint is below this.",
        flags=("--min-similarity",),
        ge=-1,
        le=1,
    )
    min_alignment: float = setting(1.5, "Warn below this alignment with the base's top directions.", command_line=False)
    top_k: int = setting(DEFAULT_TOP_K, "Singular directions per matrix.", command_line=False)
    min_delta: float = setting(1e-4, "Reject as a no-op when the largest ||dW||/||W|| is below this.", ge=0)
    min_total_norm: float = setting(
        1.0,
        "Reject as a no-op when sqrt(sum ||scaling*B@A||^2) is below this (the paper's rule, for 7-8B models).",
        ge=0,
    )
    min_kl: float = setting(1e-3, "A no-op below this KL (with the greedy token kept).", command_line=False)
    min_noop_top1: float = setting(0.95, "A no-op keeps the greedy token on more than this share.", command_line=False)
    max_kl: float = setting(20.0, "With --behaviour: reject above this KL as likely made on another base.", ge=0)
    max_base_kl: float = setting(1e-3, "The given base's KL from the fingerprinted one.", command_line=False)
    ngram: int = setting(13, "Leakage n-gram length (whitespace words).", ge=1)
    max_contaminated_share: float = setting(
        0.01,
        "Fail when a larger share of holdout items is found in the training data.",
        flags=("--max-contaminated",),
        ge=0,
        le=1,
    )
