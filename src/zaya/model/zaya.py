"""The ZAYA1 decoder: embedding + input affine, blocks of (CCA attention, MoE) with residual scaling, final RMSNorm,
tied LM head, and incremental decoding / ``generate``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from zaya.config import ModelConfig
from zaya.model.attention import Attention, AttentionCache
from zaya.model.fused_norm import join_residual, residual_norm, rms_norm
from zaya.model.layers import InputAffine, ResidualScale, RMSNorm, RotaryEmbedding
from zaya.model.loss import cross_entropy
from zaya.model.moe import MoEBlock


@dataclass
class DecodeState:
    """Everything needed to continue a batch of sequences one step at a time."""

    caches: list[AttentionCache]
    """One per layer: KV cache plus the CCA convolution and value-shift state."""
    key_valid: torch.Tensor
    """[B, capacity] bool: which cached positions hold real (non-padding) tokens."""
    length: int = 0
    """Positions filled so far (the same for every sequence; left padding counts as positions)."""
    has_padding: bool = False
    """Whether any cached position is padding (then every step needs an explicit attention mask)."""

    @property
    def capacity(self) -> int:
        return self.key_valid.shape[1]


@dataclass
class ZayaOutput:
    """What a forward pass returns."""

    logits: torch.Tensor
    """[B, T, V] next-token logits."""
    loss: torch.Tensor | None = None
    """Mean cross-entropy over labels != -100, when labels were given."""
    tokens_per_expert: torch.Tensor | None = None
    """[num_layers, router classes] tokens routed to each expert (last column: skip), padding excluded."""
    aux_loss: torch.Tensor | None = None
    """``router_aux_loss_coef`` times the sum over layers of the auxiliary load-balancing loss (training with
    gradients only; None when the coefficient is 0). Not part of ``loss``: the trainer adds it to what it
    differentiates, so logged and validation losses stay the language-model loss."""
    state: DecodeState | None = field(default=None, repr=False)
    """The decode state passed in, advanced past this call's tokens."""


class Block(nn.Module):
    """Pre-norm CCA attention then MoE, each joined to the residual stream by a ResidualScale."""

    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.attn_residual = ResidualScale(cfg.hidden_size)
        self.moe_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.moe = MoEBlock(cfg, layer_index)
        self.moe_residual = ResidualScale(cfg.hidden_size)
        self.residual_fp32 = cfg.residual_fp32

    def forward(self, x: torch.Tensor, prev_latent: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                token_mask: torch.Tensor | None, attn_mask: torch.Tensor | None, cache: AttentionCache | None,
                cache_start: int, documents: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        h = rms_norm(self.attn_norm, x.to(self.attn_norm.weight.dtype))
        a = self.attention(h, cos, sin, token_mask, attn_mask, cache, cache_start, documents)
        x, h = residual_norm(self.attn_residual, a, x, self.moe_norm, self._residual_dtype())
        m, latent, counts, aux = self.moe(h, prev_latent, token_mask)
        x = join_residual(self.moe_residual, m, x, self._residual_dtype())
        if latent is not None and (torch.compiler.is_compiling() or latent._is_view()):
            # A block's outputs cross FSDP2 unit boundaries, and FSDP2 warns about (and can lose the backward hook
            # of) an output that is a view; the first layer's latent is the down projection's reshaped output.
            # The copy is [B, T, router_hidden_size], small next to the residual stream. Compiled, it is always
            # made (dynamo cannot ask whether a traced tensor is a view; inductor writes the copy as it computes).
            latent = latent.clone()
        return x, latent, counts, aux

    def _join(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self._residual_dtype())

    def _residual_dtype(self) -> torch.dtype:
        return torch.float32 if self.residual_fp32 else self.attn_norm.weight.dtype


class ZayaForCausalLM(nn.Module):
    """ZAYA1-style MoE language model. ``model(input_ids)`` returns a ``ZayaOutput`` with ``.logits``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.input_affine = InputAffine(config.hidden_size)
        self.rope = RotaryEmbedding(config.rotary_dim, config.rope_theta)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.final_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.activation_checkpointing = False
        """Recompute each block's activations in the backward (``train.activation_checkpointing``)."""
        self.cross_entropy = cross_entropy
        """The loss of a forward with labels: the chunked eager one, or its compiled form (``zaya.train.compile``)."""
        self.reset_parameters()

    # ----------------------------------------------------------------------------------------------- init
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every weight and buffer (also used after materialising a meta-device model)."""
        cfg = self.config
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        nn.init.normal_(self.embed.weight, std=std)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=std)
        self.rope.reset_parameters()
        for module in self.modules():
            if isinstance(module, (RMSNorm, ResidualScale, InputAffine)):
                for name, p in module.named_parameters():
                    p.fill_(1.0 if ("scale" in name or name == "weight") else 0.0)
        for block in self.blocks:
            block.attention.reset_parameters(std, out_std)
            block.moe.reset_parameters(std, cfg.num_layers)

    # ----------------------------------------------------------------------------------------------- forward
    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        state: DecodeState | None = None,
        logits_to_keep: int = 0,
        document_mask: bool = False,
    ) -> ZayaOutput:
        """Run the decoder.

        input_ids: [B, T] token ids in [0, vocab_size); not checked here (that would read them back to the host on
            every call): use ``check_input_ids`` on untrusted input (``generate`` does, on the prompt).
        attention_mask: [B, T] with 1 for real tokens and 0 for padding (left padding for batched generation).
            Padding is zeroed before the CCA convolutions, masked out as keys, and left out of router statistics.
        position_ids: [B, T] or [T]; default ``arange(T)`` offset by the decode state's length (as in the
            Hugging Face port: attention scores depend only on position differences, so left padding is harmless);
            under context parallelism the tokens' global indices (``sequence_seam``).
        labels: [B, T] next-token targets aligned with input positions (-100 = ignore) -> ``loss``.
        state: a ``DecodeState`` from ``new_state`` to continue from; it is advanced in place.
        logits_to_keep: if > 0, compute logits only for the last this-many positions.
        document_mask: attention stays inside each packed document, a document being a run of tokens whose
            ``position_ids`` count up from 0 (``data.document_positions``); needs position_ids, no state, no mask.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        if t == 0:
            raise ValueError("input_ids has no tokens")
        start = 0 if state is None else state.length
        if state is not None and start + t > state.capacity:
            raise ValueError(f"decode state holds {state.capacity} positions; {start} used, {t} more requested")
        device = input_ids.device

        token_mask = None
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                                 f"{tuple(input_ids.shape)} (pass the mask of this call's tokens only)")
            # Kept even when it is all ones: deciding that would read it back to the host. An all-ones mask gives the
            # same results through the explicit-mask attention path (generate() drops one once, on the prompt).
            token_mask = attention_mask.to(device=device, dtype=torch.bool)
        attn_mask = self._attention_mask(token_mask, state, start, t, device)
        if state is not None:
            state.key_valid[:, start:start + t] = True if token_mask is None else token_mask
            state.has_padding = state.has_padding or token_mask is not None

        seam = self.blocks[0].attention.seam
        if position_ids is None:
            if state is not None:
                position_ids = torch.arange(start, start + t, device=device)[None]
            else:
                position_ids = seam.global_index(t, device)[None]
        elif position_ids.dim() == 1:
            position_ids = position_ids[None]
        documents = None
        if document_mask:
            if state is not None or token_mask is not None:
                raise ValueError("document_mask needs a forward without a decode state or attention_mask")
            # A document starts where the positions restart: its start's global index is index - position.
            documents = (seam.global_index(t, device)[None] - position_ids).expand(b, t)
        x = self.input_affine(self.embed(input_ids))
        cos, sin = self.rope.cos_sin(position_ids)
        x = x.float() if self.config.residual_fp32 else x

        latent = None
        counts, aux_losses = [], []
        for i, block in enumerate(self.blocks):
            cache = None if state is None else state.caches[i]
            x, latent, c, aux = self._run_block(block, x, latent, cos, sin, token_mask, attn_mask, cache, start,
                                                documents)
            counts.append(c)
            if aux is not None:
                aux_losses.append(aux)
        if state is not None:
            state.length = start + t

        if logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        h = rms_norm(self.final_norm, x.to(self.final_norm.weight.dtype))
        logits = F.linear(h, self.head_weight())
        loss = None
        if labels is not None:
            if logits_to_keep > 0:
                labels = labels[:, -logits_to_keep:]
            loss = self.cross_entropy(logits, labels)
        aux_loss = self.config.router_aux_loss_coef * torch.stack(aux_losses).sum() if aux_losses else None
        return ZayaOutput(logits=logits, loss=loss, tokens_per_expert=torch.stack(counts), aux_loss=aux_loss,
                          state=state)

    def _run_block(self, block: Block, x, latent, cos, sin, token_mask, attn_mask, cache, start, documents):
        """One block; with ``activation_checkpointing`` on and gradients enabled, its activations are recomputed in
        the backward instead of kept (non-reentrant checkpointing; the block is deterministic, the routers'
        statistics come from the forward only)."""
        if self.activation_checkpointing and torch.is_grad_enabled() and cache is None:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(block, x, latent, cos, sin, token_mask, attn_mask, None, start, documents,
                              use_reentrant=False)
        return block(x, latent, cos, sin, token_mask, attn_mask, cache, start, documents)

    def set_sequence_seam(self, seam) -> None:
        """Install a ``zaya.model.attention.SequenceSeam`` in every attention layer (context parallelism);
        ``LOCAL_SEQUENCE`` puts the default back."""
        for block in self.blocks:
            block.attention.seam = seam

    @property
    def sequence_seam(self):
        return self.blocks[0].attention.seam

    def set_rope_theta(self, theta: float) -> None:
        """Use RoPE base ``theta`` from now on (a long-context stage raises it); the frequency table is recomputed
        only when it changes."""
        if self.rope.theta != theta:
            self.rope.theta = theta
            self.rope.reset_parameters()

    def check_input_ids(self, input_ids: torch.Tensor) -> None:
        """Raise ValueError, naming the offending id, if ``input_ids`` holds an id outside [0, vocab_size).

        Reads the ids' minimum and maximum back to the host (one read); ``forward`` does not call it."""
        if input_ids.numel() == 0:
            return
        vocab = self.config.vocab_size
        low, high = torch.stack(torch.aminmax(input_ids.detach())).tolist()
        if high >= vocab or low < 0:
            bad = high if high >= vocab else low
            raise ValueError(f"input_ids hold id {bad}, outside [0, vocab_size={vocab})")

    @staticmethod
    def _attention_mask(token_mask: torch.Tensor | None, state: DecodeState | None, start: int, t: int,
                        device: torch.device) -> torch.Tensor | None:
        """[B, 1, T, S] bool mask (True = may attend), or None where plain causal / attend-all suffices."""
        if state is None and token_mask is None:
            return None
        if state is not None and t == 1 and token_mask is None and not state.has_padding:
            return None
        end = start + t
        if state is not None:
            valid = state.key_valid[:, :end].clone()
            if token_mask is not None:
                valid[:, start:] = token_mask
            else:
                valid[:, start:] = True
        else:
            valid = token_mask
        q_pos = torch.arange(start, end, device=device)
        k_pos = torch.arange(end, device=device)
        allowed = (k_pos[None, :] <= q_pos[:, None])[None, None] & valid[:, None, None, :]
        # A padding query with no valid key would give NaN; let it attend to itself (its output is never used).
        lonely = ~allowed.any(dim=-1, keepdim=True)
        return allowed | (lonely & (k_pos[None, :] == q_pos[:, None])[None, None])

    # ----------------------------------------------------------------------------------------------- decoding
    def new_state(self, batch: int, capacity: int | None = None, dtype: torch.dtype | None = None) -> DecodeState:
        """An empty decode state for ``batch`` sequences of up to ``capacity`` tokens (default max_seq_len)."""
        capacity = capacity or self.config.max_seq_len
        param = self.embed.weight
        dtype = dtype or param.dtype
        caches = [blk.attention.new_cache(batch, capacity, dtype, param.device) for blk in self.blocks]
        return DecodeState(caches=caches, key_valid=torch.zeros(batch, capacity, dtype=torch.bool,
                                                                device=param.device))
