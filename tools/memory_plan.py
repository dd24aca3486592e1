"""Per-rank peak memory of one GRPO training step: a plan, term by term, and its check on this CPU.

    python tools/memory_plan.py                                     # the table: which setups fit which GPUs
    python tools/memory_plan.py --model 3B --strategy fsdp --gpus 4 --gpu_gb 80 --rollout_batch_size 64
    python tools/memory_plan.py --model 7B --strategy lora --gpus 1 --gpu_gb 80 --lora_rank 32
    python tools/memory_plan.py --validate                          # plan vs measured peak RSS on this CPU
    python tools/memory_plan.py --host [--validate_host]            # host RAM of start-up per rank and node

A step's peak is the largest of its phases' peaks (docs/memory_plan.md):
  refresh   (FSDP only) the rollout copy refilled from the policy, one gathered parameter at a time
  rollout   `generate` with a KV cache, no grad, at most R rows per call
  log-probs the old and reference log-prob passes, no grad, micro-batches of m conversations
  update    forward + backward of m conversations (activation checkpointing on or off), then AdamW
Each phase = what the rank keeps resident (strategy: DDP, FSDP or LoRA) + what the phase allocates.
Sizes are in GiB (2^30 bytes), printed as "GB".

1. model shapes and parameter counts          2. the setup (one rank's configuration)
3. resident state of each strategy             4. activations: per layer, per token, counted
5. the phases and the step's peak              6. the table and the breakdown
7. validation on this CPU (a fresh subprocess per phase, VmHWM)     8. command line
"""
import argparse
import ctypes
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30
CHUNK_ELEMENTS = 2**24  # grpo.CHUNK_ELEMENTS, repeated so the plan runs without torch (the validation checks they agree)


# ---------------------------------------------------------------------------------------------
# 1. Model shapes and parameter counts
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dims:
    """A decoder-only transformer (Llama / Qwen2 family): what its memory depends on."""
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool  # lm_head shares the embedding matrix
    qkv_bias: bool  # Qwen2 has biases on q, k and v
    head_dim: int = 0  # 0: hidden // heads
    known: str = ""  # the published size, as a check of the count

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads


MODELS = {
    "135M": Dims("SmolLM2-135M (embedded default)", 576, 30, 9, 3, 1536, 49152, True, False, known="135M"),
    "0.5B": Dims("Qwen2.5-0.5B", 896, 24, 14, 2, 4864, 151936, True, True, known="0.49B"),
    "1.5B": Dims("Qwen2.5-1.5B", 1536, 28, 12, 2, 8960, 151936, True, True, known="1.54B"),
    "3B": Dims("Qwen2.5-3B", 2048, 36, 16, 2, 11008, 151936, True, True, known="3.09B"),
    "7B": Dims("Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, False, True, known="7.62B"),
}


def dims_from_config(path: str) -> Dims:
    """Dims from a Hugging Face config.json (Llama, Qwen2 and alike)."""
    c = json.load(open(path))
    qkv_bias = c.get("model_type") == "qwen2" or bool(c.get("attention_bias", False))
    return Dims(os.path.basename(os.path.dirname(os.path.abspath(path))) or path, c["hidden_size"], c["num_hidden_layers"],
                c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"]), c["intermediate_size"],
                c["vocab_size"], bool(c.get("tie_word_embeddings", False)), qkv_bias, c.get("head_dim") or 0)


def layer_linears(d: Dims) -> dict:
    """(in_features, out_features) of each linear layer of one decoder layer."""
    q, kv = d.heads * d.hd, d.kv_heads * d.hd
    return {"q_proj": (d.hidden, q), "k_proj": (d.hidden, kv), "v_proj": (d.hidden, kv), "o_proj": (q, d.hidden),
            "gate_proj": (d.hidden, d.intermediate), "up_proj": (d.hidden, d.intermediate),
            "down_proj": (d.intermediate, d.hidden)}


def layer_params(d: Dims) -> int:
    """One decoder layer: the seven linears, q/k/v biases (Qwen2), two RMSNorm weights.

        q: H x (n_h d_h) [+ n_h d_h]   k, v: H x (n_kv d_h) [+ n_kv d_h]   o: (n_h d_h) x H
        gate, up: H x I   down: I x H   norms: 2 H
    """
    weights = sum(i * o for i, o in layer_linears(d).values())
    bias = (d.heads + 2 * d.kv_heads) * d.hd if d.qkv_bias else 0
    return weights + bias + 2 * d.hidden


def root_params(d: Dims) -> int:
    """Everything outside the decoder layers: embeddings V x H, the final norm H, lm_head V x H if untied."""
    return d.vocab * d.hidden * (1 if d.tied else 2) + d.hidden


def count_params(d: Dims) -> int:
    """P = L x layer + root."""
    return d.layers * layer_params(d) + root_params(d)


def lora_params(d: Dims, rank: int, targets) -> int:
    """Adapter parameters A = sum over layers and target linears of r x (in_features + out_features)."""
    return d.layers * sum(rank * (i + o) for name, (i, o) in layer_linears(d).items() if name in targets)


# ---------------------------------------------------------------------------------------------
# 2. The setup: one rank's configuration
# ---------------------------------------------------------------------------------------------
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Setup:
    """One rank of a run. Defaults: the paper preset's shapes (256 questions x G 5 per step, micro-batch 4,
    conversations of 3,500 tokens, bf16, activation checkpointing, kl_coef 0.001 so a reference is needed)."""
    dims: Dims
    strategy: str = "fsdp"  # ddp | fsdp | lora
    gpus: int = 1  # W ranks
    precision: str = "bf16"  # bf16 (autocast over float32 trained weights) | no (float32 everywhere)
    rollout_batch_size: int = 64  # R: rows per generate call (0: all the rank's rows at once)
    batch_size: int = 256  # questions per step, all ranks
    group_size: int = 5  # G
    micro_batch_size: int = 4  # m: conversations per forward (log-prob passes and update)
    tokens: int = 3500  # T: a conversation's tokens (update, log-prob passes)
    response_tokens: int = 0  # logits kept per row (grpo keeps only the response's); 0: T (upper bound)
    context_tokens: int = 3500  # T_ctx: a rollout row's context at its longest (KV cache length)
    prefill_tokens: int = 1536  # tokens one generate call prefills per row (a turn prompt, or a tool response)
    new_tokens: int = 0  # (validation only) tokens generated after a prefill of `context_tokens`
    checkpointing: bool = True
    reference: bool = True  # kl_coef > 0
    reference_on_cpu: bool = False
    lora_rank: int = 32
    lora_targets: tuple = LORA_TARGETS
    temperature: float = 1.0
    top_k: int = 10000
    top_p: float = 0.99
    device: str = "gpu"  # gpu | cpu: which AdamW path runs (foreach on GPU, one tensor at a time on CPU)
    runtime_bytes: float = 1.0 * GiB  # GPU: CUDA context, cuBLAS/NCCL workspaces, allocator slack (assumed)
    runtime_note: str = "assumed: CUDA context + workspaces + allocator slack"
    autocast_cache: bool = True  # torch.autocast caches bf16 copies of float32 parameters until the region exits
    optimizer: bool = True  # (validation) False: a bare model, no gradients or AdamW state (rollout / log-prob processes)

    @property
    def P(self) -> int:
        return count_params(self.dims)

    @property
    def b_act(self) -> int:
        """Bytes of an activation element: 2 under bf16 autocast, 4 in float32."""
        return 2 if self.precision == "bf16" else 4

    @property
    def autocast(self) -> bool:
        return self.precision == "bf16"

    @property
    def rows_per_rank(self) -> int:
        return self.batch_size * self.group_size // self.gpus

    @property
    def rows_per_call(self) -> int:
        """train.rollout_in_chunks takes R // G questions per chunk: G x (R // G) rows (at least one question)."""
        if not self.rollout_batch_size:
            return self.rows_per_rank
        return min(self.rows_per_rank, self.group_size * max(1, self.rollout_batch_size // self.group_size))

    @property
    def keep(self) -> int:
        """Logit rows per conversation: grpo.token_logprobs keeps the response's (+1); T as an upper bound."""
        return self.response_tokens or self.tokens


def label(s: Setup) -> str:
    """The strategy's printed name."""
    return {"ddp": "DDP", "fsdp": "FSDP", "lora": f"LoRA r={s.lora_rank}"}[s.strategy]


# ---------------------------------------------------------------------------------------------
# 3. Resident state: what a rank keeps between phases (per strategy)
# ---------------------------------------------------------------------------------------------
@dataclass
class Term:
    name: str
    bytes: float
    formula: str


def resident(s: Setup, phase: str) -> list[Term]:
    """What the strategy keeps on the device in `phase` (refresh, rollout, logprobs, update, step).
    Gradients exist only in update and step (zero_grad(set_to_none=True) after every update)."""
    return {"ddp": resident_ddp, "fsdp": resident_fsdp, "lora": resident_lora}[s.strategy](s, phase)


def reference_term(s: Setup, phase: str) -> list[Term]:
    """The frozen KL reference, a copy in the run's precision: b_act x P; under FSDP sharded as the
    policy is (b_act x P / W). With --reference_on_cpu it is whole, and on the device only during its
    own log-prob pass (train.reference_pass)."""
    if not s.reference:
        return [Term("reference", 0, "kl_coef 0: no reference")]
    if s.reference_on_cpu and phase != "logprobs":
        return [Term("reference", 0, "--reference_on_cpu: in CPU RAM now (2 x P bytes there)")]
    if s.strategy == "fsdp" and not s.reference_on_cpu:  # sharded as the policy is; its pass gathers unit by unit
        terms = [Term("sharded reference", s.b_act * s.P / s.gpus, "b_act x P / W")]
        if phase == "logprobs":
            lay, root = layer_params(s.dims), root_params(s.dims)
            terms.append(Term("gathered reference units", s.b_act * (2 * lay + root), "b_act x (2 layers + root unit)"))
        return terms
    note = " (moved in for its pass)" if s.reference_on_cpu else ""
    return [Term("reference copy", s.b_act * s.P, f"b_act x P{note}")]


def autocast_cache_term(s: Setup, trained_params: int, where: str, phase: str) -> list[Term]:
    """torch.autocast keeps the bf16 cast of every float32 parameter that requires grad until the
    outermost autocast region exits: 2 x (float32 params run under autocast). train.py opens one region
    around the whole rollout, one around both log-prob passes, one per micro-batch (forward + backward).
    With cache_enabled=False (--no_autocast_cache) the casts are per call, except that a backward without
    checkpointing still saves every layer's cast weight (2 x params again)."""
    if not (s.autocast and s.device == "gpu"):
        return []
    if s.autocast_cache:
        return [Term("autocast weight cache", 2 * trained_params, f"2 x {where}: bf16 casts of float32 weights, held per region")]
    if phase == "update" and not s.checkpointing:
        return [Term("saved bf16 weight casts", 2 * trained_params, f"2 x {where}: each linear saves its cast weight")]
    return [Term("autocast weight cache", 0, "cache_enabled=False: one cast at a time")]


def resident_ddp(s: Setup, phase: str) -> list[Term]:
    """DDP (or one GPU), full fine-tuning: float32 weights 4P, AdamW moments 8P, gradients 4P in the update;
    gradient_as_bucket_view=True: DDP's buckets are the gradients (else + 4P)."""
    P = s.P
    terms = [Term("weights (float32)", 4 * P, "4 x P")]
    if s.optimizer:
        terms.append(Term("AdamW moments", 8 * P, "8 x P (exp_avg, exp_avg_sq, float32)"))
    if phase in ("update", "step") and s.optimizer:
        terms.append(Term("gradients", 4 * P, "4 x P (float32)"))
        if s.gpus > 1:
            terms.append(Term("DDP buckets", 0, f"0: gradient_as_bucket_view=True (without it + 4 x P = {gb(4 * P)})"))
    if s.optimizer:
        terms += reference_term(s, phase)
    if phase != "step":  # the step runs outside autocast
        terms += autocast_cache_term(s, P, "P", phase)
    return terms


def resident_fsdp(s: Setup, phase: str) -> list[Term]:
    """FSDP full fine-tuning: (4P + 4P + 8P) / W sharded state, a full rollout copy of the policy in the
    run's precision (b_act x P, refreshed before each rollout), the reference as in DDP. In the update the
    decoder layers are all-gathered two at a time (the running one + the prefetched one) and the root unit
    (embeddings, lm_head, final norm) stays gathered from forward to the end of backward, with its
    unsharded gradient; counted in float32 to be safe (a bf16 FSDP mixed-precision policy halves it)."""
    P, W, d = s.P, s.gpus, s.dims
    terms = [Term("sharded weights", 4 * P / W, "4 x P / W"), Term("sharded AdamW moments", 8 * P / W, "8 x P / W")]
    if phase in ("update", "step"):
        terms.append(Term("sharded gradients", 4 * P / W, "4 x P / W"))
    terms.append(Term("rollout copy", s.b_act * P, "b_act x P (full policy, each rank)"))
    terms += reference_term(s, phase)
    if phase == "update":
        lay, root = layer_params(d), root_params(d)
        terms.append(Term("gathered params", 4 * (2 * lay + root), "4 x (2 layers + root unit), float32 assumed"))
        terms.append(Term("unsharded grads", 4 * (lay + root), "4 x (1 layer + root unit) before reduce-scatter"))
    if phase == "refresh":
        terms.append(Term("one gathered parameter", s.b_act * largest_param(s) * (1 + 1 / s.gpus),
                          "b_act x (1 + 1/W) x the largest parameter: train.copy_policy_into casts a shard, then gathers it"))
    return terms


def resident_lora(s: Setup, phase: str) -> list[Term]:
    """LoRA: the frozen base in the run's precision (b_act x P), float32 adapters A with their
    gradients and AdamW moments (16 x A in the update); no reference copy (the base with the adapter
    disabled is the reference), no rollout copy."""
    A = lora_params(s.dims, s.lora_rank, s.lora_targets)
    terms = [Term("frozen base", s.b_act * s.P, "b_act x P"),
             Term("adapter weights + AdamW", 12 * A, f"12 x A, A = {A / 1e6:.1f}M")]
    if phase in ("update", "step"):
        terms.append(Term("adapter gradients", 4 * A, "4 x A"))
    terms.append(Term("reference", 0, "the base, adapter disabled"))
    if phase != "step":
        terms += autocast_cache_term(s, A, "A", phase)
    return terms


def trained_params(s: Setup) -> int:
    """Parameters AdamW updates on this rank (its step's temporaries scale with them)."""
    if s.strategy == "lora":
        return lora_params(s.dims, s.lora_rank, s.lora_targets)
    return s.P // s.gpus if s.strategy == "fsdp" else s.P


def largest_param(s: Setup) -> int:
    """Elements of the largest trained tensor (the embedding V x H; LoRA: the largest adapter matrix)."""
    d = s.dims
    return d.vocab * d.hidden if s.strategy != "lora" else max(s.lora_rank * (i + o) for i, o in layer_linears(d).values())


# ---------------------------------------------------------------------------------------------
# 4. Activations: per layer, per token, counted from the code path (transformers' Llama/Qwen2 with
#    SDPA, autocast, grpo's chunked log-softmax). s = residual stream bytes (the weights' dtype:
#    4 for float32 weights, b_act for a bf16 base or copy), c = b_act, p = max(c, s) (rotary: a bf16
#    projection times float32 cos/sin promotes to float32).
# ---------------------------------------------------------------------------------------------
def saved_per_layer(d: Dims, s: int, c: int, autocast: bool, t_kv: int) -> list[tuple[str, int]]:
    """Bytes per token that one decoder layer saves for backward (no checkpointing): 17 tensors in
    float32, 20 under autocast (each linear saves its own cast of its input):

        2 RMSNorms          2 x (4H + sH)   float32 input (pow), normalised (weight mul)
        q, k, v inputs      3cH with autocast (one cast per linear), else sH (one shared input)
        SDPA q, K, V        3pH -> 3cH      K, V repeated to all heads (padding makes a mask: no GQA kernel)
        SDPA out + lse      cH + 4 n_h
        o_proj input        cH              the transposed contiguous copy
        converted mask      c x t_kv        SDPA's float copy of the boolean mask, saved per layer
        gate, up inputs     2cH with autocast, else sH
        gate, silu, up, *   4cI             (gate for silu, silu and up for the product, product for down)
    """
    H, I = d.hidden, d.intermediate
    return [("2 RMSNorms", 2 * (4 * H + s * H)), ("q/k/v inputs", 3 * c * H if autocast else s * H),
            ("SDPA q,K,V", 3 * c * H), ("SDPA out + logsumexp", c * H + 4 * d.heads), ("o_proj input", c * H),
            ("converted mask", c * t_kv), ("gate/up inputs", 2 * c * H if autocast else s * H), ("MLP 4 x I", 4 * c * I)]


def nograd_layer_peak(d: Dims, s: int, c: int, autocast: bool, t_q: int, t_kv: int, lora: bool = False) -> tuple[float, str]:
    """Peak bytes of one row inside one decoder layer without grad (tensors freed as soon as unused).

        attention:  t_q (2sH + pH + cH [+ 2cH casts]) + t_kv (pH + cH [+ cH cast]) (K, V repeated) + c t_q t_kv (mask)
                    layer input x and the norm output live on; q after rotary, SDPA's output
        MLP:        t_q (3sH + 3cI)     x, the residual, the norm output; silu(gate), up, their product
                    LoRA (peft): down_proj's adapter casts its input to float32, then autocast back to c:
                    t_q (3sH + max(3c, 2c + 4) I)
    """
    H, I, p = d.hidden, d.intermediate, max(c, s)
    casts = autocast and p != c
    attention = (t_q * (2 * s * H + p * H + c * H + (2 * c * H if casts else 0))
                 + t_kv * (p * H + c * H + (c * H if casts else 0)) + c * t_q * t_kv)
    mlp = t_q * (3 * s * H + max(3 * c, 2 * c + 4 if lora else 0) * I)
    return max(attention, mlp), ("attention" if attention > mlp else "MLP")


def sampling_bytes_per_row(vocab: int, c: int, temperature: float, top_k: int, top_p: float) -> tuple[int, str]:
    """Bytes per row per decoding step (x vocab), counted in transformers' sampling loop and agent's recorder:

        model logits c, their float32 copy 4, the recorder's log-softmax 4 (kept a step)   = c + 8
        then the largest of: recorder (scaled 4 + the old log-softmax 4)                     8
                             temperature (its output 4), top-k (bool 1 + output 4 + its input 4)
                             top-p (input 4, sorted 4, int64 indices 8, cumsum 4, 2 bools, output 4) 26
                             softmax probs (input 4 + probs 4)                               8
    """
    base = c + 8
    steps = [8, 8]
    if temperature != 1.0:
        steps.append(4 + 4)
    if top_k:
        steps.append(4 + 1 + 4)
    if top_p < 1.0:
        steps.append(4 + 4 + 8 + 4 + 1 + 1 + 4)
    extra = max(steps)
    return (base + extra) * vocab, f"({c} + 8 + {extra}) x V"


def chunk_bytes(vocab: int) -> int:
    """One float32 chunk of grpo's log-softmax: (CHUNK_ELEMENTS // V) rows x V x 4 bytes (<= 64 MiB)."""
    return max(1, CHUNK_ELEMENTS // vocab) * vocab * 4


# ---------------------------------------------------------------------------------------------
# 5. The phases and the step's peak
# ---------------------------------------------------------------------------------------------
def runtime_term(s: Setup) -> Term:
    """GPU: assumed (CUDA context, workspaces, allocator slack); CPU: measured."""
    return Term("runtime", s.runtime_bytes, s.runtime_note)


def rollout_stream_bytes(s: Setup) -> int:
    """Weights' dtype of the model that generates: DDP the float32 policy, FSDP its b_act rollout copy,
    LoRA the b_act base."""
    return 4 if s.strategy == "ddp" else s.b_act


def kv_cache(s: Setup, rows: int, length: int) -> Term:
    """rows x length x layers x n_kv x d_h x (K bytes + V bytes). K takes rotary's dtype p = max(c, s):
    float32 when float32 weights run under autocast (cos/sin follow the float32 residual stream)."""
    d, c = s.dims, s.b_act
    k = max(c, rollout_stream_bytes(s))
    per_token = d.layers * d.kv_heads * d.hd * (k + c)
    return Term("KV cache", rows * length * per_token, f"{rows} rows x {length} x L x n_kv x d_h x ({k} + {c})")


def rollout_phase(s: Setup) -> list[Term]:
    """Rollout: resident (no gradients) + the larger of two moments of a generate call over R rows:

        prefill  KV cache of T_ctx + one layer's activations for the prefilled tokens (t_q per row,
                 attending to t_kv = T_ctx) + the boolean mask R x t_q x t_kv (shared by the layers)
                 + the last position's logits and their float32 copy R x V x (c + 4)
        decode   KV cache of T_ctx (+ new tokens) + one layer's K and V again (the cache's torch.cat)
                 + the sampling buffers of one step (sampling_bytes_per_row)
    """
    d, c, st = s.dims, s.b_act, rollout_stream_bytes(s)
    rows = s.rows_per_call
    t_q = s.context_tokens if s.new_tokens else s.prefill_tokens  # validation: the whole prompt is prefilled
    layer, where = nograd_layer_peak(d, st, c, s.autocast, t_q, s.context_tokens, s.strategy == "lora")
    prefill = [kv_cache(s, rows, s.context_tokens),
               Term("prefill activations", rows * (layer + t_q * s.context_tokens + d.vocab * (c + 4)),
                    f"{rows} rows x ({where} of one layer at {t_q} x {s.context_tokens} + bool mask + last logits)")]
    kv = kv_cache(s, rows, s.context_tokens + s.new_tokens)
    sample, formula = sampling_bytes_per_row(d.vocab, c, s.temperature, s.top_k, s.top_p)
    decode = [kv, Term("KV cat (one layer again)", kv.bytes / d.layers, "KV / L"),
              Term("sampling buffers", rows * sample, f"{rows} rows x {formula}")]
    return max(prefill, decode, key=lambda terms: sum(t.bytes for t in terms))


def logprob_phase(s: Setup) -> list[Term]:
    """Old and reference log-probs (no grad), m conversations of T tokens at a time: the larger of

        one layer   m x (nograd_layer_peak at T x T) + the boolean mask m x T x T
        head        logits m x keep x V x c (returned in the model's dtype) + the larger of the final
                    norm's output with lm_head's input cast (m x (sHT + cH keep)) and two float32
                    chunks (the upcast chunk, logsumexp's temporary)
    The old pass runs the rolling-out model (DDP: the float32 policy, s = 4); the reference is b_act."""
    d, c, m, T = s.dims, s.b_act, s.micro_batch_size, s.tokens
    st = rollout_stream_bytes(s)
    layer, where = nograd_layer_peak(d, st, c, s.autocast, T, T, s.strategy == "lora")
    one_layer = m * layer + m * T * T
    logits = m * s.keep * d.vocab * c
    rest = max(m * (st * d.hidden * T + (c * d.hidden * s.keep if s.autocast else 0)), 2 * chunk_bytes(d.vocab))
    if one_layer >= logits + rest:
        return [Term("one layer (no grad)", one_layer, f"{m} x {T} tokens, {where} + bool mask")]
    return [Term("logits", logits, f"m x keep x V x {c} = {m} x {s.keep} x {d.vocab} x {c}"),
            Term("norm output / 2 chunks", rest, "max(m x (sHT + cH keep), 2 x 64 MiB)")]


def update_phase(s: Setup) -> list[Term]:
    """Forward + backward of m conversations of T tokens (trained weights' stream s = 4, LoRA b_act):

        stored   checkpointing: L x sH per token (each layer's input); else L x saved_per_layer
        then the largest of three moments of the backward:
        top      final norm (4H + sH) x T, lm_head input (cH x keep under autocast, else the norm
                 output sH x T), logits m x keep x V x c (their gradient is written into the same
                 memory, grpo), and the larger of 4 float32 chunks (forward with entropy, or
                 backward) and lm_head's weight gradient V x H x c (the mm's output)
        layer    (logits freed) one layer's backward: with checkpointing its recomputed
                 saved_per_layer; temporaries 3cI + 12H per token; its largest weight gradient
                 I x H x (c + 4); tied embeddings: + lm_head's float32 weight gradient V x H x 4,
                 which waits in autograd's input buffer until the embedding's gradient arrives
        end      the embedding's dense gradient V x H x 4; tied: + the waiting one + their sum
                 (out of place: lm_head's gradient is a transposed view), 3 x V x H x 4
    LoRA trains no head or embedding: no weight-gradient terms there.
    """
    d, c, m, T = s.dims, s.b_act, s.micro_batch_size, s.tokens
    H, I, VH = d.hidden, d.intermediate, d.vocab * d.hidden
    st = s.b_act if s.strategy == "lora" else 4
    per_layer = sum(b for _, b in saved_per_layer(d, st, c, s.autocast, T))
    tokens, full = m * T, s.strategy != "lora"
    if s.checkpointing:
        stored = Term("checkpointed layer inputs", d.layers * tokens * st * H, f"L x m x T x H x {st}")
    else:
        stored = Term("all layers' activations", d.layers * tokens * per_layer,
                      f"L x m x T x {per_layer} B/token (saved_per_layer)")
    top = [Term("final norm + lm_head input", tokens * (4 * H + st * H) + m * (c * H * s.keep if s.autocast else st * H * T),
                "m x T x (4H + sH) + lm_head input"),
           Term("logits (+ their gradient in place)", m * s.keep * d.vocab * c, f"m x keep x V x {c}"),
           Term("chunks / lm_head weight gradient", max(4 * chunk_bytes(d.vocab), VH * c if full else 0),
                f"max(4 x 64 MiB chunks, V x H x {c})")]
    held = 4 * VH if full and d.tied else 0
    layer_bytes = tokens * (3 * c * I + 12 * H) + (I * H * ((c + 4) if s.autocast else 4) if full else 0)
    layer = [Term("one layer's backward" + (" (recomputed)" if s.checkpointing else ""),
                  layer_bytes + (tokens * per_layer if s.checkpointing else 0),
                  ("m x T x saved_per_layer + " if s.checkpointing else "") + "m x T x (3cI + 12H) + I x H x (c + 4)"),
             Term("lm_head gradient waiting (tied)", held, "V x H x 4 in autograd's input buffer")][:2 if held else 1]
    last = [Term("embedding gradient" + (" x 3 (tied)" if d.tied else ""), (3 if d.tied else 1) * 4 * VH if full else 0,
                 "waiting + embedding's + their sum, V x H x 4 each" if d.tied else "V x H x 4")]
    moments = [[stored] + top, [stored] + layer, last]
    return max(moments, key=lambda terms: sum(t.bytes for t in terms))


def step_phase(s: Setup) -> list[Term]:
    """AdamW's step after the micro-batches (activations freed): GPU foreach AdamW takes sqrt(v) of
    every trained tensor at once (4 bytes x trained params on the rank); CPU steps one tensor at a time
    (sqrt(v) and the denominator of the largest tensor: 2 x 4 bytes)."""
    if s.device == "gpu":
        return [Term("AdamW foreach temporary", 4 * trained_params(s), "4 x trained params (torch._foreach_sqrt)")]
    return [Term("AdamW temporaries", 8 * largest_param(s), "2 x 4 x largest tensor (single-tensor AdamW on CPU)")]


def phases(s: Setup) -> dict:
    """{phase: [terms]}: resident + the phase's own terms + runtime."""
    out = {}
    if s.strategy == "fsdp":
        out["refresh"] = resident(s, "refresh")
    out["rollout"] = resident(s, "rollout") + rollout_phase(s)
    out["logprobs"] = resident(s, "logprobs") + logprob_phase(s)
    out["update"] = resident(s, "update") + update_phase(s)
    out["step"] = resident(s, "step") + step_phase(s)
    return {k: v + [runtime_term(s)] for k, v in out.items()}


def peak(s: Setup) -> tuple[float, str]:
    """The step's peak (bytes) and the phase that sets it."""
    totals = {k: sum(t.bytes for t in v) for k, v in phases(s).items()}
    phase = max(totals, key=totals.get)
    return totals[phase], phase


# ---------------------------------------------------------------------------------------------
# 6. The table and the breakdown
# ---------------------------------------------------------------------------------------------
def gb(x: float) -> str:
    """Bytes as GiB, printed "GB"."""
    return f"{x / GiB:.1f} GB"


def rollout_candidates(rows: int) -> list[int]:
    """R values tried, largest first: the rank's rows, then 256, 128, ..., 5 (one question's group)."""
    return [r for r in dict.fromkeys([rows, 256, 128, 64, 32, 16, 8, 5]) if r <= rows]


def best_fit(s: Setup, gpu_gb: float):
    """The largest R (rows per rank first) that fits, with the reference on the GPU if it fits, else on the
    CPU; (setup, peak) or (None, peak at R=5 with the reference on the CPU)."""
    for r in rollout_candidates(s.rows_per_rank):
        for on_cpu in (False, True) if s.reference and s.strategy != "lora" else (False,):
            t = dataclasses.replace(s, rollout_batch_size=r, reference_on_cpu=on_cpu)
            p, _ = peak(t)
            if p <= gpu_gb * GiB:
                return t, p
    t = dataclasses.replace(s, rollout_batch_size=5, reference_on_cpu=s.reference and s.strategy != "lora")
    return None, peak(t)[0]


def fit_line(s: Setup, gpu_gb: float) -> str:
    """e.g. `3B FSDP 4x80: fits, R=128, peak 61.2 GB` or `no (needs 93.0 GB at R=5)`."""
    t, p = best_fit(s, gpu_gb)
    head = f"{s.dims.name.split()[0]} {label(s)} {s.gpus}x{gpu_gb:g}"
    if t is None:
        return f"{head}: no (needs {gb(p)} at R=5, reference on CPU)"
    ref = ", reference on CPU" if t.reference_on_cpu else ""
    return f"{head}: fits, R={t.rollout_batch_size} ({t.rows_per_call} rows per call){ref}, peak {gb(p)} ({peak(t)[1]})"


GPUS, SIZES = (1, 2, 4, 8), (24, 48, 80)


TIGHT = 0.9  # a fit above 90% of the card's size is marked: GPU allocator fragmentation is not modelled


def table(base: Setup, models=("0.5B", "1.5B", "3B", "7B")) -> str:
    """One line per model x strategy; a cell per W x GB: the largest R that fits ('c': reference on the
    CPU; '*': peak above 90% of the card; '-': does not fit even at R=5 with the reference on the CPU)."""
    cols = [(w, g) for w in GPUS for g in SIZES]
    lines = ["model strategy   " + " ".join(f"{w}x{g:<4d}" for w, g in cols)]
    for name in models:
        for strategy in ("ddp", "fsdp", "lora"):
            cells = []
            for w, g in cols:
                s = dataclasses.replace(base, dims=MODELS[name], strategy=strategy, gpus=w)
                t, p = best_fit(s, g)
                tight = "*" if t is not None and p > TIGHT * g * GiB else ""
                cells.append("-" if t is None else f"{t.rollout_batch_size}{'c' if t.reference_on_cpu else ''}{tight}")
            lines.append(f"{name:<5} {label(s):<10} " + " ".join(f"{x:<6}" for x in cells))
    return "\n".join(lines)


def peak_table(base: Setup, models=("0.5B", "1.5B", "3B", "7B")) -> str:
    """Peak per rank at the setup's own R (reference on the GPU), per W: one line per model x strategy."""
    lines = [f"model strategy   " + " ".join(f"W={w:<12d}" for w in GPUS)]
    for name in models:
        for strategy in ("ddp", "fsdp", "lora"):
            cells = []
            for w in GPUS:
                s = dataclasses.replace(base, dims=MODELS[name], strategy=strategy, gpus=w)
                total, phase = peak(s)
                cells.append(f"{total / GiB:5.1f} {phase:<8}")
            lines.append(f"{name:<5} {label(s):<10} " + " ".join(f"{x:<14}" for x in cells))
    return "\n".join(lines)


def breakdown(s: Setup) -> str:
    """Every phase, term by term, and the step's peak."""
    d = s.dims
    P = count_params(d)
    out = [f"{d.name}: P = {P:,} ({P / 1e9:.3f}B; published {d.known or '?'}), {label(s)}, W={s.gpus}, precision {s.precision}, "
           f"R={s.rollout_batch_size} ({s.rows_per_call} rows per call of {s.rows_per_rank} per rank), m={s.micro_batch_size}, "
           f"T={s.tokens}, T_ctx={s.context_tokens}, checkpointing {'on' if s.checkpointing else 'off'}, "
           f"reference {'on CPU' if s.reference_on_cpu else 'on device' if s.reference else 'none'}"]
    for phase, terms in phases(s).items():
        out.append(f"  {phase:<9} {gb(sum(t.bytes for t in terms)):>9}")
        out += [f"    {t.name:<34} {gb(t.bytes):>9}   {t.formula}" for t in terms]
    total, phase = peak(s)
    out.append(f"  peak {gb(total)} ({phase})")
    return "\n".join(out)


def param_check() -> str:
    """The counted parameters beside the published sizes."""
    return "\n".join(f"  {k:<5} {count_params(d):>14,}  = {count_params(d) / 1e9:.3f}B   published {d.known}"
                     for k, d in MODELS.items())


def goals(base: Setup) -> str:
    """The questions the plan answers, true or false."""
    def fits(name, strategy, w, g):
        return best_fit(dataclasses.replace(base, dims=MODELS[name], strategy=strategy, gpus=w), g)[0] is not None
    ddp3 = [f"{w}x{g}" for w in GPUS for g in SIZES if fits("3B", "ddp", w, g)]

    def at(name, strategy, w):
        total, phase = peak(dataclasses.replace(base, dims=MODELS[name], strategy=strategy, gpus=w))
        return f"{gb(total)} ({phase})"
    lines = [fit_line(dataclasses.replace(base, dims=MODELS["3B"], strategy="fsdp", gpus=4), 80),
             fit_line(dataclasses.replace(base, dims=MODELS["3B"], strategy="ddp", gpus=4), 80),
             fit_line(dataclasses.replace(base, dims=MODELS["3B"], strategy="lora", gpus=1), 24),
             fit_line(dataclasses.replace(base, dims=MODELS["7B"], strategy="lora", gpus=1), 80),
             f"at R={base.rollout_batch_size}: 3B FSDP 4 GPUs {at('3B', 'fsdp', 4)}, 3B DDP 4 GPUs {at('3B', 'ddp', 4)}, "
             f"3B LoRA 1 GPU {at('3B', 'lora', 1)}, 7B LoRA 1 GPU {at('7B', 'lora', 1)}",
             f"paper preset, 3B, FSDP, 4 x 80 GB fits: {fits('3B', 'fsdp', 4, 80)}",
             f"3B under DDP fits: {', '.join(ddp3) if ddp3 else 'nowhere in the table'}",
             f"3B LoRA (r={base.lora_rank}) fits 1 x 24 GB: {fits('3B', 'lora', 1, 24)}",
             f"7B LoRA (r={base.lora_rank}) fits 1 x 80 GB: {fits('7B', 'lora', 1, 80)}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# 7. Validation on this CPU: each phase in a fresh subprocess, its VmHWM against the plan
# ---------------------------------------------------------------------------------------------
VALIDATION = {  # random-weight models; shapes sized for ~1-2 minutes per process on 2 cores
    "135M": dict(rows=8, prompt=512, new=64, micro=2, tokens=512),
    "0.5B": dict(rows=4, prompt=256, new=32, micro=2, tokens=256),
}
TOLERANCE = 0.15


def proc_status(key: str) -> float:
    """A /proc/self/status field in bytes (VmHWM: peak resident set, VmRSS: resident now)."""
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024


def reset_peak():
    """Restart VmHWM from the resident size now (as tools/runs.peak_memory(reset=True)), after a trim, so that
    the peak covers the phase and not the model's construction (from_config builds an untied lm_head
    before tying it: V x H x 4 more for a moment)."""
    malloc_trim()
    open("/proc/self/clear_refs", "w").write("5")
    return proc_status("VmRSS")


def malloc_trim():
    """glibc: hand freed heap memory back (tools/runs.release_freed_memory does this after rollouts and updates)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def import_runtime():
    """What every measured process imports: torch, transformers' model classes, the project's modules."""
    sys.path.insert(0, ROOT)
    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401
    from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: F401

    import agent  # noqa: F401
    import grpo
    assert grpo.CHUNK_ELEMENTS == CHUNK_ELEMENTS, "grpo.CHUNK_ELEMENTS changed: update the plan"


def load_tokenizer():
    """The embedded default's tokenizer, from its GGUF file (no weights), as tests/conftest.py does."""
    from transformers import AutoTokenizer

    import agent
    folder, name = os.path.split(agent.default_model_file())
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.padding_side = "left"
    return tok


def build_model(size: str, pad_id: int, eos_id: int):
    """A random float32 model of `size`'s shape (LlamaConfig for 135M, Qwen2Config for 0.5B)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    d = MODELS[size]
    kind = Qwen2Config if d.qkv_bias else LlamaConfig
    config = kind(vocab_size=d.vocab, hidden_size=d.hidden, intermediate_size=d.intermediate, num_hidden_layers=d.layers,
                  num_attention_heads=d.heads, num_key_value_heads=d.kv_heads, tie_word_embeddings=d.tied,
                  max_position_embeddings=4096, pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=eos_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == count_params(d), "the plan's parameter count is off"
    return model


def conversations(n: int, tokens: int, vocab: int, shorter: int = 16):
    """n synthetic conversations of `tokens` tokens (the first one `shorter` tokens shorter, so rows are
    padded and the attention mask is materialised as in training): a quarter prompt, the rest response,
    every response token trained; old/reference log-probs and advantages are arbitrary numbers."""
    import random

    import agent
    rng = random.Random(0)
    out = []
    for k in range(n):
        prompt = tokens // 4 - (shorter if k == 0 else 0)
        response = tokens - tokens // 4
        out.append(agent.Conversation(prompt_ids=[rng.randrange(3, vocab) for _ in range(prompt)],
                                      response_ids=[rng.randrange(3, vocab) for _ in range(response)],
                                      loss_mask=[1] * response, logprobs=[0.0] * response,
                                      old_logprobs=[-3.0] * response, ref_logprobs=[-3.1] * response,
                                      advantage=1.0 if k % 2 else -1.0))
    return out


def measure_runtime(size: str) -> dict:
    """(a) imports only: VmHWM is the CPU plan's runtime term; then the tokenizer's resident cost."""
    import_runtime()
    out = {"runtime": proc_status("VmHWM")}
    before = proc_status("VmRSS")
    load_tokenizer()
    out["tokenizer"] = proc_status("VmRSS") - before
    out["tokenizer_load_hwm"] = proc_status("VmHWM")
    return out


def measure_rollout(size: str) -> dict:
    """(b) agent.generate on R random prompts of up to T tokens (rows differ in length by 8 tokens each)."""
    import_runtime()
    import torch

    import agent
    v = VALIDATION[size]
    tok = load_tokenizer()
    model = build_model(size, tok.pad_token_id, tok.eos_token_id).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, len(tok), (v["prompt"] - 8 * k,), generator=g).tolist() for k in range(v["rows"])]
    build = proc_status("VmHWM")
    start = reset_peak()
    t0 = time.time()
    torch.manual_seed(0)
    gens = agent.generate(model, tok, prompts, max_new_tokens=v["new"], temperature=1.0, top_p=1.0, top_k=0)
    return {"peak": proc_status("VmHWM"), "seconds": time.time() - t0, "new_tokens": max(len(x.ids) for x in gens),
            "build_peak": build, "start": start}


def measure_logprobs(size: str) -> dict:
    """(d) grpo.response_logprobs (no grad) over one micro-batch of m synthetic conversations."""
    import_runtime()
    import torch

    import grpo
    v = VALIDATION[size]
    model = build_model(size, 2, 2)
    convs = conversations(v["micro"], v["tokens"], MODELS[size].vocab)
    build = proc_status("VmHWM")
    start = reset_peak()
    t0 = time.time()
    grpo.response_logprobs(model, convs, 2, torch.device("cpu"), v["micro"], 1.0)
    return {"peak": proc_status("VmHWM"), "seconds": time.time() - t0, "build_peak": build, "start": start}


def measure_update(size: str, checkpointing: bool) -> dict:
    """(c) one steady-state micro-batch: AdamW's moments and the gradients already exist (a first step on
    zero gradients creates the moments; the gradients are kept, as for a micro-batch after the first),
    then grpo.micro_logprobs + grpo.policy_loss (KL to recorded reference log-probs, entropy bonus),
    backward, gradient clipping, AdamW step, zero_grad(set_to_none), malloc_trim."""
    import_runtime()
    import torch

    import grpo
    v = VALIDATION[size]
    model = build_model(size, 2, 2).train()
    if checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates exp_avg and exp_avg_sq
    warm = proc_status("VmHWM")
    start = reset_peak()
    convs = conversations(v["micro"], v["tokens"], MODELS[size].vocab)
    fields = ("loss_mask", "old_logprobs", "ref_logprobs", "advantage")
    t0 = time.time()
    (logprobs, entropy), f = grpo.micro_logprobs(model, convs, 2, torch.device("cpu"), fields, 1.0, True)
    loss, _ = grpo.policy_loss(logprobs, f["old_logprobs"], f["advantage"], f["loss_mask"], f["ref_logprobs"],
                               kl_coef=0.001, entropy=entropy, entropy_coef=0.001, num_tokens=f["loss_mask"].sum())
    loss.backward()
    after_backward = proc_status("VmHWM")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    rss = proc_status("VmRSS")
    malloc_trim()
    return {"peak": proc_status("VmHWM"), "seconds": time.time() - t0, "first_step_peak": warm, "start": start,
            "after_backward": after_backward, "rss_before_trim": rss, "rss_after_trim": proc_status("VmRSS")}


MEASURES = {"runtime": measure_runtime, "rollout": measure_rollout, "logprobs": measure_logprobs,
            "update": lambda size: measure_update(size, True), "update_nockpt": lambda size: measure_update(size, False)}


FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # glibc: blocks >= 128 KiB mmapped, unmapped when freed


def run_measure(what: str, size: str, env: dict | None = None) -> dict:
    """One measurement in a fresh Python process (so its VmHWM covers that phase only); `env` adds
    environment variables (FIXED_MMAP: no heap retention of freed large blocks)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_measure", what, "--model", size]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env or {})})
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def cpu_setup(size: str, runtime: float, note: str, **kw) -> Setup:
    """The CPU plan: float32 everywhere ("no"), one process, no DDP, no reference copy, measured runtime."""
    v = VALIDATION[size]
    return Setup(MODELS[size], strategy="ddp", gpus=1, precision="no", micro_batch_size=v["micro"], tokens=v["tokens"],
                 response_tokens=v["tokens"] - v["tokens"] // 4 + 1, reference=False, device="cpu", runtime_bytes=runtime,
                 runtime_note=note, batch_size=v["rows"], group_size=1, rollout_batch_size=v["rows"],
                 temperature=1.0, top_k=0, top_p=1.0, **kw)


def validation_plans(size: str, runtime: dict, new_tokens: int) -> dict:
    """{check: (Setup, phase)}: the plan each measured process is compared with."""
    v = VALIDATION[size]
    note = "measured: VmHWM of a process that only imports"
    rt = runtime["runtime"]
    rollout = cpu_setup(size, rt + runtime["tokenizer"], note + " + the tokenizer's resident size", optimizer=False,
                        context_tokens=v["prompt"], new_tokens=new_tokens)
    bare = cpu_setup(size, rt, note, optimizer=False)
    return {"rollout": (rollout, "rollout"), "logprobs": (bare, "logprobs"),
            "update": (cpu_setup(size, rt, note), "update"),
            "update_nockpt": (cpu_setup(size, rt, note, checkpointing=False), "update")}


def plan_total(s: Setup, phase: str) -> tuple[float, float]:
    """(total, dynamic part) of a phase's plan; for the update the larger of update and step."""
    ph = phases(s)
    names = ("update", "step") if phase == "update" else (phase,)
    best = max(names, key=lambda n: sum(t.bytes for t in ph[n]))
    static = sum(t.bytes for t in resident(s, best)) + s.runtime_bytes
    total = sum(t.bytes for t in ph[best])
    return total, total - static


def cpu_name() -> str:
    """`lscpu`'s model name and CPU count."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(x.split(":", 1)[1].strip() for x in out.splitlines() if x.startswith("Model name"))
        cores = next(x.split(":", 1)[1].strip() for x in out.splitlines() if x.startswith("CPU(s)"))
        return f"{name}, {cores} CPUs"
    except (OSError, StopIteration):
        return "unknown CPU"


def validate(sizes=("135M", "0.5B"), checks=("rollout", "logprobs", "update", "update_nockpt")) -> bool:
    """Plan vs measured VmHWM per phase and size, each in a fresh process, twice: glibc's default
    allocator (what train.py runs with) and a fixed mmap threshold (freed blocks of 128 KiB or more go
    back to the OS at once: the live peak without heap retention). PASS: within 15% of the plan's total."""
    print(f"CPU: {cpu_name()}; torch {torch_version()}; {datetime.date.today()}")
    print("CPU plan: precision no (float32 weights, KV cache, logits), one process, no DDP, no reference copy;\n"
          "runtime term measured (VmHWM of a process that only imports); VmHWM reset after each model is built;\n"
          "'dynamic' = peak minus the plan's static part (runtime + weights [+ gradients + AdamW])\n")
    ok = {"default": True, "fixed mmap": True}
    header = (f"{'size':<5} {'check':<14} {'plan':>13} | {'glibc default':>13} {'ratio':>6} {'':4} | {'fixed mmap':>13} "
              f"{'ratio':>6} {'':4} | dynamic MiB: plan, default, fixed")
    lines = []
    for size in sizes:
        runtime = {name: run_measure("runtime", size, env) for name, env in (("default", None), ("fixed mmap", FIXED_MMAP))}
        print(f"{size}: runtime (imports) {runtime['default']['runtime'] / 2**20:.0f} MiB (fixed mmap "
              f"{runtime['fixed mmap']['runtime'] / 2**20:.0f} MiB), tokenizer +{runtime['default']['tokenizer'] / 2**20:.0f} "
              f"MiB (its load peaks at {runtime['default']['tokenizer_load_hwm'] / 2**20:.0f} MiB, before any model)")
        for check in checks:
            row, dyn = [], []
            for name, env in (("default", None), ("fixed mmap", FIXED_MMAP)):
                m = run_measure(check, size, env)
                s, phase = validation_plans(size, runtime[name], m.get("new_tokens", 0))[check]
                total, dynamic = plan_total(s, phase)
                ratio = m["peak"] / total
                passed = abs(ratio - 1) <= TOLERANCE
                ok[name] &= passed
                row.append(f"{m['peak'] / 2**20:>9.0f} MiB {ratio:6.3f} {'PASS' if passed else 'FAIL'}")
                dyn.append((m["peak"] - (total - dynamic)) / 2**20)
                detail = ", ".join(f"{k} {x / 2**20:.0f} MiB" if isinstance(x, int) and x > 2**20 else f"{k} {x}"
                                   for k, x in m.items() if not isinstance(x, float)) + f", {m['seconds']:.0f} s"
                print(f"  {check:<14} [{name}] {detail}")
            lines.append(f"{size:<5} {check:<14} {total / 2**20:>9.0f} MiB | {row[0]} | {row[1]} | "
                         f"{dynamic / 2**20:.0f}, {dyn[0]:.0f}, {dyn[1]:.0f}")
            print("\n".join("      " + x for x in breakdown_phase(s, phase).splitlines()))
    print("\n" + header + "\n" + "\n".join(lines))
    print(f"\nglibc default: {'all PASS' if ok['default'] else 'some FAIL'}; fixed mmap threshold: "
          f"{'all PASS' if ok['fixed mmap'] else 'some FAIL'} (tolerance {TOLERANCE:.0%})")
    return ok["default"]


def torch_version() -> str:
    """torch and transformers versions."""
    import torch
    import transformers
    return f"{torch.__version__}, transformers {transformers.__version__}"


def breakdown_phase(s: Setup, phase: str) -> str:
    """A validation phase's terms in MiB, one line (update: also the step)."""
    ph = phases(s)
    names = ("update", "step") if phase == "update" else (phase,)
    return "\n".join(f"{n}: " + ", ".join(f"{t.name} {t.bytes / 2**20:.0f}" for t in ph[n] if t.bytes) + " (MiB)"
                     for n in names)


# ---------------------------------------------------------------------------------------------
# 7b. Host memory of start-up (train.load_models): per rank and per node
# ---------------------------------------------------------------------------------------------
HOST_RUNTIME_GPU = 3.0 * GiB  # assumed: the CUDA libraries and context's host side, Python, torch, transformers
RETRIEVER_NODE = 64.6 * GiB + 1.0 * GiB  # wiki-18's flat index (page cache, shared) + corpus offsets and e5 on the CPU


def host_start_up(d: Dims, strategy: str, ranks: int, where: str = "gpu", base: float = HOST_RUNTIME_GPU) -> list[Term]:
    """Host peak of start-up of each rank (a list, one per rank), as train.load_models runs it.
    F = the checkpoint's bytes (bfloat16, as released: 2P). DDP: every rank loads the float32 policy,
    holding it and the file's tensors at once (4P + F), then `prepare` moves it to its GPU. FSDP:
    every rank starts from an empty model and reads the checkpoint one tensor at a time into its
    shards (runs.load_shards): the largest tensor in float32 and as read (4VH + 2VH). The frozen
    copies are made on their device from the policy (on GPUs, no host memory). where="cpu" (the
    check on this machine) counts what lives on the device too: the policy's shard 4P/n, the
    reference's 2P/n, the whole rollout copy 2P and one gathered parameter 2VH."""
    P, F, VH = count_params(d), 2 * count_params(d), d.vocab * d.hidden
    if strategy == "lora":
        return [Term("base", base + 2 * P + F, "runtime + 2P (bf16 base) + F")]
    if strategy == "ddp":
        return [Term("each rank", base + 4 * P + F, "runtime + 4P + F")] * ranks
    if where == "gpu":
        return [Term("each rank", base + 6 * VH, "runtime + 4VH + 2VH (one tensor read)")] * ranks
    resident = 4 * P / ranks + 2 * P / ranks + 2 * P
    return [Term("each rank", base + resident + 2 * VH, "runtime + 4P/n + 2P/n + 2P + 2VH")] * ranks


def host_table() -> str:
    """Host RAM a 4-GPU node needs for start-up, per rank and per node."""
    lines = [f"host RAM of start-up on GPUs, runtime {gb(HOST_RUNTIME_GPU)} per process assumed; node: all ranks, "
             f"plus {gb(RETRIEVER_NODE)} when the wiki-18 server runs on the same node", "",
             "| model | strategy | ranks | each rank | node | node + retriever |", "| --- " * 6 + "|"]
    for size in ("3B", "7B"):
        for strategy, ranks in (("ddp", 4), ("fsdp", 4), ("lora", 1)):
            terms = host_start_up(MODELS[size], strategy, ranks)
            node = sum(t.bytes for t in terms)
            lines.append(f"| {size} | {strategy.upper() if strategy != 'lora' else 'LoRA'} | {ranks} | {gb(terms[0].bytes)} "
                         f"| {gb(node)} | {gb(node + RETRIEVER_NODE)} |")
    return "\n".join(lines)


def validate_host() -> bool:
    """bench/host_memory.py (0.5B shapes, FSDP2, 2 processes, reference and rollout copy) against
    host_start_up(where="cpu"), each rank's own measured VmRSS before the model as its runtime."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import host_memory
    measured = host_memory.main([])
    ok = True
    for rank, (peak_gib, base_gib) in sorted(measured.items()):
        plan = host_start_up(MODELS["0.5B"], "fsdp", 2, where="cpu", base=base_gib * GiB)[rank]
        ratio = peak_gib * GiB / plan.bytes
        ok &= abs(ratio - 1) <= TOLERANCE
        print(f"rank {rank}: plan {gb(plan.bytes)} ({plan.formula}), measured {peak_gib:.2f} GB: "
              f"{ratio:.3f} {'PASS' if abs(ratio - 1) <= TOLERANCE else 'FAIL'}")
    return ok


# ---------------------------------------------------------------------------------------------
# 8. Command line
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    """The breakdown's flags (train.py's names where they exist), --validate, and the internal --_measure."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, choices=list(MODELS), help="a breakdown for this model (else the table)")
    ap.add_argument("--config", default=None, help="an HF config.json instead of --model")
    ap.add_argument("--strategy", default="fsdp", choices=["ddp", "fsdp", "lora"])
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--gpu_gb", type=float, default=80)
    ap.add_argument("--rollout_batch_size", type=int, default=64, help="R rows per generate call (0: all the rank's rows)")
    ap.add_argument("--micro_batch_size", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=3500, help="T: a conversation's tokens and the rollout's context T_ctx")
    ap.add_argument("--prefill_tokens", type=int, default=1536, help="tokens one generate call prefills per row")
    ap.add_argument("--response_tokens", type=int, default=0, help="logit rows kept per conversation (0: T, an upper bound)")
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--group_size", type=int, default=5)
    ap.add_argument("--reference_on_cpu", action="store_true")
    ap.add_argument("--no_reference", action="store_true", help="kl_coef 0: no reference model")
    ap.add_argument("--no_checkpointing", action="store_true")
    ap.add_argument("--no_autocast_cache", action="store_true", help="autocast with cache_enabled=False (not train.py's)")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "no"])
    ap.add_argument("--lora_rank", type=int, default=32)
    ap.add_argument("--runtime_gb", type=float, default=1.0, help="GPU runtime term (assumed)")
    ap.add_argument("--validate", action="store_true", help="plan vs measured peak RSS on this CPU")
    ap.add_argument("--host", action="store_true", help="host RAM of start-up per rank and per node (3B, 7B)")
    ap.add_argument("--validate_host", action="store_true", help="the host plan vs bench/host_memory.py on this CPU")
    ap.add_argument("--_measure", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def setup_from_args(args, dims: Dims) -> Setup:
    """The Setup the flags describe (T sets both the conversations' and the rollout's context)."""
    return Setup(dims, strategy=args.strategy, gpus=args.gpus, precision=args.precision,
                 rollout_batch_size=args.rollout_batch_size, batch_size=args.batch_size, group_size=args.group_size,
                 micro_batch_size=args.micro_batch_size, tokens=args.tokens, context_tokens=args.tokens,
                 prefill_tokens=min(args.prefill_tokens, args.tokens), response_tokens=args.response_tokens,
                 checkpointing=not args.no_checkpointing, reference=not args.no_reference,
                 reference_on_cpu=args.reference_on_cpu, lora_rank=args.lora_rank, runtime_bytes=args.runtime_gb * GiB,
                 autocast_cache=not args.no_autocast_cache)


def main(argv=None):
    """Table and goals by default; a breakdown with --model/--config; the CPU check with --validate."""
    args = parse_args(argv)
    if args._measure:
        print(json.dumps(MEASURES[args._measure](args.model)))
        return
    if args.validate:
        sys.exit(0 if validate() else 1)
    if args.host or args.validate_host:
        print(host_table())
        if args.validate_host:
            sys.exit(0 if validate_host() else 1)
        return
    if args.model or args.config:
        dims = dims_from_config(args.config) if args.config else MODELS[args.model]
        s = setup_from_args(args, dims)
        print(breakdown(s))
        total, phase = peak(s)
        verdict = "fits" if total <= args.gpu_gb * GiB else "does not fit"
        print(f"{verdict} in {args.gpu_gb:g} GB; best for this GPU: {fit_line(s, args.gpu_gb)}")
        return
    base = setup_from_args(args, MODELS["3B"])
    print("parameter counts (from the dims):\n" + param_check())
    print(f"\npaper preset: {base.batch_size} questions x G {base.group_size} per step, T = T_ctx = {base.tokens}, "
          f"m = {base.micro_batch_size}, {base.precision}, checkpointing {'on' if base.checkpointing else 'off'}, "
          f"reference {'none' if not base.reference else 'needed'}, LoRA r = {base.lora_rank}, runtime {gb(base.runtime_bytes)} "
          f"assumed\ncell: the largest R (rows per generate call) that fits; c: reference on the CPU; -: no fit at R=5\n")
    print(table(base))
    print(f"\npeak per rank in GB (and the phase that sets it) at R = {base.rollout_batch_size} "
          f"({base.rows_per_call} rows per call), reference on the GPU:\n")
    print(peak_table(base))
    print("\n" + goals(base))


if __name__ == "__main__":
    main()
