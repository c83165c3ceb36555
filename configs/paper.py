"""The paper's setup (arXiv 2505.15548): GPT-2-style 6L, 6 heads x 32, d=192, PG-19, T=2048.

LS: 1 global + 5 local heads with window 51: the author's model passes ``window_size=(50, 0)``
(span 50) to flash-attention, so query i sees keys i-50..i, i.e. 51 keys in our convention
(``window`` counts the keys a query sees, itself included; see the README's window table).
AdamW lr 6e-4, betas (0.9, 0.95), weight decay 0.1, clip 1.0, 2000 warmup steps then cosine,
bf16 compute, SentencePiece 10K vocabulary.
Needs TFDS pg19 prepared in ``data.data_dir`` and a SentencePiece model (see README).
"""

import dataclasses

from ls_jax.config import Config, DataConfig, ModelConfig, TrainConfig

SPM_PATH = "tokenizers/pg19_spm10k.model"
PAPER_SPAN = 50  # the paper's local span: keys i - span .. i
PAPER_WINDOW = PAPER_SPAN + 1  # = 51 keys, query included


def paper() -> Config:
    """The paper's LS model: 6 layers, d=192, 1 global + 5 local heads (window 51), PG-19."""
    return Config(
        name="paper",
        model=ModelConfig(vocab_size=10_000, n_layer=6, d_model=192, n_head=6, head_dim=32,
                          n_global_heads=1, window=PAPER_WINDOW, max_seq_len=2048,
                          compute_dtype="bfloat16"),
        data=DataConfig(source="tfds:pg19", text_field="book_text", tokenizer=f"sentencepiece:{SPM_PATH}",
                        seq_len=2048, shuffle_window=4096),
        train=TrainConfig(batch_size=256, num_steps=50_000, lr=6e-4, min_lr=6e-5, warmup_steps=2000,
                          b1=0.9, b2=0.95, weight_decay=0.1, grad_clip=1.0, log_every=50,
                          eval_every=1000, eval_batches=16, save_every=1000),
    )


def paper_mhsa() -> Config:
    """paper with plain multi-head self-attention: all 6 heads global."""
    cfg = paper()
    return dataclasses.replace(cfg, name="paper_mhsa",
                               model=dataclasses.replace(cfg.model, n_global_heads=6))


def paper_qknorm() -> Config:
    """paper_mhsa with QK-normalisation (a stabilising baseline)."""
    cfg = paper_mhsa()
    return dataclasses.replace(cfg, name="paper_qknorm",
                               model=dataclasses.replace(cfg.model, qk_norm=True))


def paper_zloss() -> Config:
    """paper_mhsa with z-loss 1e-4 * logsumexp^2 (the regulariser the paper's author also tried)."""
    cfg = paper_mhsa()
    return dataclasses.replace(cfg, name="paper_zloss",
                               train=dataclasses.replace(cfg.train, z_loss=1e-4))
