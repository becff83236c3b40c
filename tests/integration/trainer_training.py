"""Two optimizer steps of a trainer's OWN EAGLE-3 training code on CPU, fed by an hsx export read
with the trainer's own reader. Run in a child process whose path holds the trainers' packages
(installed --no-deps by scripts/bootstrap.sh into .venv/trainers):

    python -m tests.integration.trainer_training speculators EXPORT_DIR VERIFIER_DIR
    python -m tests.integration.trainer_training specforge EXPORT_DIR TARGET_DIR VOCAB_DIR
    python -m tests.integration.trainer_training modelopt EXPORT_DIR BASE_MODEL_DIR

TARGET_DIR is a sharded copy of the target model (SpecForge's TargetHead reads
model.safetensors.index.json); VOCAB_DIR is what ``hsx vocab`` wrote. Each runs the trainer's
model forward, backward and an AdamW step in a hand loop (their own Trainer classes need CUDA).
Prints one line, ``RESULT {json}``: each step's loss and gradient norm, and what was trained on."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

STEPS = 2
MAX_LEN = 256  # tokens per packed / padded batch
TTT_STEPS = 3  # draft steps unrolled per batch (test-time training)


def _step(
    loss: torch.Tensor, optimizer: torch.optim.Optimizer, record: dict[str, list[float]]
) -> None:
    """Backward and one optimizer step; records the loss and the trainable parameters' gradient
    norm (zero would mean the loss reached none of them)."""
    optimizer.zero_grad()
    loss.backward()
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    record["losses"].append(float(loss.detach()))
    record["grad_norms"].append(float(torch.nn.utils.get_total_norm([p.grad for p in params])))
    optimizer.step()


def train_speculators(out: Path, verifier: Path) -> dict[str, Any]:
    """speculators 0.9.0: Eagle3DraftModel in a hand loop (its Trainer moves every batch to
    ``local_rank`` and calls ``torch.accelerator``: GPU only)."""
    from speculators.losses.utils import resolve_loss_config
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from torch.utils.data import DataLoader
    from transformers import AutoConfig

    manifest = json.loads((out / "hsx-export.json").read_text())
    aux_layers = list(manifest["aux_layer_ids_vllm"])
    config = AutoConfig.from_pretrained(verifier)
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    draft_vocab = 64
    d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab, config.vocab_size)

    torch.manual_seed(0)
    model = Eagle3DraftModel.from_training_args(
        config,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=str(verifier),  # embeddings, lm_head and final norm from here
        target_layer_ids=aux_layers,
        draft_vocab_size=draft_vocab,
        norm_before_residual=True,
        ttt_steps=TTT_STEPS,
        num_layers=1,
        draft_attn_impl="sdpa",  # its default flex attention has no backward on CPU
    ).float()
    dataset = ArrowDataset(
        max_len=MAX_LEN, datapath=str(out), on_missing="raise", hidden_states_dtype=torch.float32
    )
    collate = CollateFn(
        max_len=MAX_LEN,
        hidden_size=config.hidden_size,
        num_target_layers=len(aux_layers),
        dtype=torch.float32,
        preprocess=shift_batch,
    )
    loader = DataLoader(dataset, batch_size=2, collate_fn=collate)
    # "eager": the torch KL loss; the default "fused" one is a Triton kernel (GPU only)
    loss_config = resolve_loss_config("kl_div", "eager")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    record: dict[str, list[float]] = {"losses": [], "grad_norms": []}
    shapes: dict[str, list[int]] = {}
    for _, batch in zip(range(STEPS), loader, strict=False):
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        shapes = {k: list(v.shape) for k, v in tensors.items()}
        _, loss, _ = model(**tensors, ttt_steps=TTT_STEPS, loss_config=loss_config)
        _step(loss, optimizer, record)
    return {**record, "rows": len(dataset), "batch": shapes, "aux_layers": aux_layers}


def train_specforge(out: Path, target: Path, vocab: Path) -> dict[str, Any]:
    """SpecForge 0.2.0: its offline EAGLE-3 path (OnlineEagle3Model over the exported target
    states passed through TargetHead) in a hand loop (its CLI wants sglang, FSDP and CUDA)."""
    import specforge.algorithms.eagle3.model as eagle3_model
    import specforge.core.loss as specforge_loss
    from specforge.algorithms.eagle3.data import build_offline_collator, normalize_offline_sample
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import (
        OfflineManifestReader,
        list_feature_files,
    )
    from transformers import AutoConfig, LlamaConfig

    # CPU only: LogSoftmaxLoss is a Triton kernel (GPU only). Put SpecForge's own torch
    # reference of the same loss (core/loss.py:_compute_loss) in its place; the model, data
    # path and optimizer step are SpecForge's unchanged.
    class TorchLogSoftmaxLoss:
        apply = staticmethod(specforge_loss._compute_loss)

    eagle3_model.LogSoftmaxLoss = TorchLogSoftmaxLoss

    files = list_feature_files(str(out))
    refs = OfflineManifestReader(str(out), validate_files=True).read()
    assert len(refs) == len(files), (len(refs), len(files))
    mapping = torch.load(vocab / "vocab_mapping.pt")
    verifier = AutoConfig.from_pretrained(target)
    draft_config = LlamaConfig(
        vocab_size=verifier.vocab_size,
        draft_vocab_size=int(mapping["d2t"].numel()),
        hidden_size=verifier.hidden_size,
        intermediate_size=verifier.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=verifier.num_attention_heads,
        num_key_value_heads=verifier.num_key_value_heads,
        max_position_embeddings=verifier.max_position_embeddings,
        rms_norm_eps=verifier.rms_norm_eps,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    draft = LlamaForCausalLMEagle3(draft_config, attention_backend="sdpa")
    draft.load_vocab_mapping(str(vocab / "vocab_mapping.pt"))
    draft.load_embedding(str(target))
    draft.freeze_embedding()
    head = TargetHead.from_pretrained(str(target)).float()
    model = OnlineEagle3Model(draft, length=TTT_STEPS, attention_backend="sdpa")
    collate = build_offline_collator()
    samples = [normalize_offline_sample(load_feature_file(f), max_len=MAX_LEN) for f in files]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    record: dict[str, list[float]] = {"losses": [], "grad_norms": []}
    shapes: dict[str, list[int]] = {}
    for step in range(STEPS):
        batch = collate(samples[2 * step : 2 * step + 2])
        shapes = {k: list(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        input_ids, target_states, loss_mask = head.preprocess(
            batch["input_ids"], batch["target"].float(), batch["loss_mask"]
        )
        plosses, *_ = model(
            input_ids=input_ids,
            attention_mask=batch["attention_mask"],
            target=head(target_states),
            loss_mask=loss_mask,
            hidden_states=batch["hidden_state"].float(),
        )
        loss = sum(0.8**i * p for i, p in enumerate(plosses))  # its default ploss decay
        _step(loss, optimizer, record)
    return {**record, "rows": len(files), "batch": shapes}


def train_modelopt(out: Path, base: Path) -> dict[str, Any]:
    """nvidia-modelopt 0.47.0: the base model converted with ``mtsp.convert(model, [("eagle",
    {"eagle_offline": True, ...})])``, fed by its OfflineSupervisedDataset and
    EagleOfflineDataCollator (the way its examples/speculative_decoding/main.py does, without HF's
    Trainer). Its loss re-applies the base model's final norm to the pre-norm exported state
    (``base_hidden_prenorm``) before the base lm_head."""
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.speculative.eagle.utils import (
        EagleOfflineDataCollator,
        OfflineSupervisedDataset,
    )
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    manifest = json.loads((out / "hsx-export.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = model.config
    draft = {
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.vocab_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "use_aux_hidden_state": True,
        # modelopt counts layers as decoder-layer outputs (its hooks sit on layers[i])
        "eagle_aux_hidden_state_layer_ids": list(manifest["aux_layer_ids_layer_outputs"]),
        "torch_dtype": "float32",
        "_attn_implementation": "sdpa",
    }
    torch.manual_seed(0)
    mtsp.convert(
        model,
        [
            (
                "eagle",
                {
                    "eagle_offline": True,
                    "eagle_architecture_config": draft,
                    "eagle_use_torch_compile": False,
                    "eagle_ttt_steps": TTT_STEPS,
                },
            )
        ],
    )
    # transformers 5.x compatibility, not a CPU change: modelopt 0.47.0 builds this lazily as
    # LlamaRotaryEmbedding(config=..., device=...), and transformers 5.x's __init__ no longer
    # takes ``device`` (TypeError). Build the same module from the same config beforehand, so
    # its _maybe_init_rope finds it; everything else is modelopt's code unchanged.
    model.eagle_module.rotary_emb = LlamaRotaryEmbedding(config=model.eagle_module.config)
    files = sorted(str(p) for p in out.rglob("*.pt"))
    dataset = OfflineSupervisedDataset(files, answer_only_loss=True)
    collate = EagleOfflineDataCollator(train_len=MAX_LEN)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    record: dict[str, list[float]] = {"losses": [], "grad_norms": []}
    shapes: dict[str, list[int]] = {}
    for step in range(STEPS):
        batch = collate([dataset[2 * step], dataset[2 * step + 1]])
        shapes = {k: list(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        output = model(**batch)
        _step(output.loss, optimizer, record)
    return {**record, "rows": len(dataset), "batch": shapes}


def main() -> None:
    format_name, out = sys.argv[1], Path(sys.argv[2])
    if format_name == "speculators":
        result = train_speculators(out, Path(sys.argv[3]))
    elif format_name == "specforge":
        result = train_specforge(out, Path(sys.argv[3]), Path(sys.argv[4]))
    elif format_name == "modelopt":
        result = train_modelopt(out, Path(sys.argv[3]))
    else:
        raise SystemExit(f"no CPU training recipe for {format_name!r}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
