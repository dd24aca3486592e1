"""Per-rank peak GPU memory of one GRPO training step, term by term (the model of tools/memory_plan.py).

A step's peak is the largest of its phases' peaks (docs/memory_plan.md):
  refresh   (FSDP only) the rollout copy refilled from the policy, one gathered parameter at a time
  rollout   `generate` with a KV cache, no grad, at most R rows per call
  log-probs the old and reference log-prob passes, no grad, micro-batches of m conversations
  update    forward + backward of m conversations (activation checkpointing on or off), then AdamW
Each phase = what the rank keeps resident (strategy: DDP, FSDP or LoRA) + what the phase allocates.
Sizes are in GiB (2^30 bytes), printed as "GB". Plain Python: no torch needed.

1. model shapes and parameter counts          2. the setup (one rank's configuration)
3. resident state of each strategy             4. activations: per layer, per token, counted
5. the phases and the step's peak
"""
import json
import os
from dataclasses import dataclass

GiB = 2**30
CHUNK_ELEMENTS = 2**24  # grpo.CHUNK_ELEMENTS, repeated so the plan runs without torch (memory_check.py checks they agree)


def gb(x: float) -> str:
    """Bytes as GiB, printed "GB"."""
    return f"{x / GiB:.1f} GB"



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
                          "b_act x (1 + 1/W) x the largest parameter: models.copy_policy_into casts a shard, then gathers it"))
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
