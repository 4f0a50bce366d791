"""Quantized mixture-of-experts experts in a compressed-tensors checkpoint: the per-expert layout engines read.

lowbit holds a MoE layer's experts fused (`QuantStack`: ``gate_up_proj`` ``[E, 2I, H]``
and ``down_proj`` ``[E, H, I]``, each expert's matrix grouped along its input like a
Linear). The file splits them into one Linear per expert and projection, under the
names a transformers ``save_pretrained`` of the float model has and vLLM's MoE loader
maps (``RoutedExperts.build_expert_params_mapping``: ``experts.{e}.gate_proj`` -> shard
w1 of ``w13``, ``up_proj`` -> w3, ``down_proj`` -> w2):

* ``model.layers.{l}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.<part>`` (Qwen3-MoE,
  Qwen2-MoE, OLMoE, DeepSeek-V3), ``model.layers.{l}.block_sparse_moe.experts.{e}.{w1,w3,w2}.<part>``
  (Mixtral: its checkpoints and vLLM's module say ``block_sparse_moe``, so every
  ``.mlp.`` key of the file, the router's too, is written under that name);
* ``<part>`` exactly what a Linear of the same recipe gets (`compressed_tensors.layer_tensors`):
  gate = rows ``[0, I)`` and up = rows ``[I, 2I)`` of an expert's ``gate_up_proj`` matrix,
  so a split keeps every group and scale (groups run along the input). gate and up of an
  expert come from one matrix and so share the NVFP4 global scale and the input scales
  vLLM requires equal (w13's ``[E, 2]`` global scales, "input_scales of w1 and w3 ... must
  be equal");
* one config group per distinct recipe whose targets are ``re:`` patterns over the expert
  projections of each layer it covers: transformers' loader picks the experts' group by a
  ``re:`` target naming ``experts``, vLLM looks up ``{layer}.experts.0.gate_proj``.

Per-expert rather than fused 3-D tensors because that is what both loaders read for these
architectures (transformers decompresses per-expert tensors and merges them; vLLM takes
both) and what every peer writes. gpt-oss is refused: vLLM reads its compressed-tensors
experts only as fused, interleaved ``w13_*`` tensors (whole or per expert) and transformers
saves and loads its experts fused, so no one layout is loaded by both.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from lowbit.errors import CheckpointError, SchemeError
from lowbit.files.specs import LayerSpec
from lowbit.formats import InputScheme, QTensor, Scheme

# the fused experts parameters the export splits (transformers 5's concatenated gate/up layout)
GATE_UP, DOWN = "gate_up_proj", "down_proj"
GPT_OSS_WHY = ("gpt-oss experts cannot be exported to compressed-tensors: vLLM's gpt-oss loader (_load_weights_other) "
               "reads them only as fused w13/w2 tensors, whole or per expert, with gate and up rows interleaved, and "
               "transformers saves and loads gpt-oss experts fused, so the per-expert gate/up/down layout loads in "
               "neither; keep the native checkpoint (`lowbit eval` reads it) or quantize with --keep experts")


@dataclass(frozen=True)
class Layout:
    """How one architecture's checkpoints name the experts: the MoE block and the three projections."""

    block: str  # the block's attribute in checkpoints ("mlp"; Mixtral "block_sparse_moe")
    gate: str
    up: str
    down: str

    def key(self, name: str) -> str:
        """A tensor or module name of the model as the checkpoint has it (Mixtral's ``.mlp.`` -> ``.block_sparse_moe.``)."""
        return name if self.block == "mlp" else name.replace(".mlp.", f".{self.block}.")

    def projections(self, experts: str) -> str:
        """The ``re:`` config target matching every expert projection of the experts module ``experts``."""
        return rf"re:^{re.escape(self.key(experts))}\.\d+\.({self.gate}|{self.up}|{self.down})$"


STANDARD = Layout("mlp", "gate_proj", "up_proj", "down_proj")
# deepseek_v3: vLLM's deepseek_v2.py maps experts.{e}.{gate,up,down}_proj (ckpt_*_proj_name) and loads the
# shared experts and MLA projections as Linears; transformers merges its per-expert tensors like Qwen's
LAYOUTS: dict[str, Layout] = {"qwen3_moe": STANDARD, "qwen2_moe": STANDARD, "olmoe": STANDARD, "deepseek_v3": STANDARD,
                              "mixtral": Layout("block_sparse_moe", "w1", "w3", "w2")}


def layout_for(model_type: str | None) -> Layout:
    """The checkpoint layout of a MoE architecture; refuses gpt-oss (see the module doc) and unknown ones by name."""
    if model_type == "gpt_oss":
        raise SchemeError(GPT_OSS_WHY)
    if model_type is None:
        return STANDARD
    if model_type not in LAYOUTS:
        raise SchemeError(f"compressed-tensors: no per-expert layout for {model_type!r} experts (checked against "
                          f"vLLM's and transformers' loaders for: {', '.join(sorted(LAYOUTS))}); keep the native "
                          "checkpoint, or quantize with --keep experts")
    return LAYOUTS[model_type]


# ------------------------------------------------------------------ checks (from specs alone)
def by_module(specs: list[LayerSpec]) -> dict[str, dict[str, LayerSpec]]:
    """experts module -> its quantized fused parameters' specs (``...mlp.experts`` -> {gate_up_proj: ..., ...})."""
    out: dict[str, dict[str, LayerSpec]] = {}
    for sp in specs:
        if sp.experts:
            module, _, param = sp.name.rpartition(".")
            out.setdefault(module, {})[param] = sp
    return out


def check(specs: list[LayerSpec], model_type: str | None) -> None:
    """Refuse experts the per-expert layout cannot hold: gpt-oss / unknown architectures, a layer whose experts are
    not quantized whole (gate_up_proj and down_proj) in one recipe -- vLLM loads one scheme per MoE layer
    (``All MoE projections need to have same quantization scheme``) and transformers decompresses all of a
    layer's experts with one group."""
    modules = by_module(specs)
    if not modules:
        return
    layout_for(model_type)
    for module, params in modules.items():
        if set(params) != {GATE_UP, DOWN}:
            odd = sorted(set(params) - {GATE_UP, DOWN})
            raise SchemeError(
                f"{module}: compressed-tensors holds experts as gate/up/down Linears, quantized together: "
                + (f"{', '.join(odd)} has no such split" if odd else
                   f"only {', '.join(params)} is quantized and vLLM loads all projections of a MoE layer in one "
                   "scheme")
                + "; quantize gate_up_proj and down_proj of every MoE layer with one recipe")
        up, down = params[GATE_UP], params[DOWN]
        if (up.scheme, up.input) != (down.scheme, down.input):
            raise SchemeError(
                f"{module}: gate_up_proj is {recipe_name(up)} but down_proj is {recipe_name(down)}; vLLM loads "
                "the gate, up and down projections of a MoE layer with one scheme (\"All MoE projections need to "
                "have same quantization scheme\") and transformers decompresses them with one config group, so "
                "compressed-tensors cannot hold this; give both one recipe (a plan may still differ between layers), "
                "or keep the native checkpoint / export --to gguf")


def recipe_name(sp: LayerSpec) -> str:
    return sp.scheme.name if sp.input is None else f"{sp.scheme.name}@{sp.input.name}"


def notes(specs: list[LayerSpec]) -> list[str]:
    """What keeps vLLM from serving a valid export's experts (its fused MoE's dispatch), or its MoE gates."""
    out = []
    for module, params in by_module(specs).items():
        sp = params.get(GATE_UP) or next(iter(params.values()))
        why = vllm_moe_limit(sp.scheme, sp.input)
        if why:
            out.append(f"{module} ({recipe_name(sp)}): {why}")
            break  # one line is enough: the other layers share the limit or have one like it
    gates = [s.name for s in specs if not s.experts and s.name.endswith(".shared_expert_gate")]
    if gates:
        out.append(f"{gates[0]} is quantized, but vLLM builds shared-expert gates unquantized (quant_config=None) "
                   "and cannot load its packed tensors; keep it 16-bit (plans leave it out unless named)")
    return out


def transformers_notes(specs: list[LayerSpec]) -> list[str]:
    """What transformers' MoE loader (5.25, ``CompressedTensorsDequantize``) cannot read back of a valid export:
    it decompresses all experts with the first experts config group and passes only ``weight_packed`` /
    ``weight_scale`` / ``weight_shape`` (or FP8 ``weight``) to the decompressor."""
    modules = by_module(specs)
    out = []
    recipes = {(p.scheme, p.input) for params in modules.values() for p in params.values()}
    if len(recipes) > 1:
        out.append(f"experts of different layers have {len(recipes)} different recipes; transformers' MoE loader "
                   "decompresses every layer's experts with the first experts config group (get_experts_scheme), "
                   "so this file loads correctly in vLLM and lowbit only")
    for scheme, _ in recipes:
        lost = ("zero points" if scheme.family.name == "int" and not scheme.sym else
                "global scales" if scheme.tensor_scale else
                None)
        if lost:
            out.append(f"{scheme.name} experts: transformers' MoE loader drops their {lost} (it reads only packed "
                       "codes and scales), so it cannot load this file; vLLM and lowbit (`lowbit eval`) read it")
            break
    return out


def vllm_moe_limit(scheme: Scheme, inp: InputScheme | None) -> str | None:
    """Why vLLM 0.32's compressed-tensors MoE (``CompressedTensorsMoEMethod.get_moe_method``) cannot run these
    experts, or None. Its dispatch, in lowbit's terms: MXFP4 / MXFP8 weights; INT weights alone (WNA16,
    pack-quantized); NVFP4 with NVFP4 or no inputs; FP8 with FP8 inputs; INT8 per row with dynamic per-token
    INT8 inputs; INT4 with dynamic per-token 8-bit inputs."""
    fam, static = scheme.family.name, inp is not None and (inp.static or inp.needs_calibration)
    if scheme.elem == "e2m1" and scheme.scale == "e8m0" or scheme.elem == "e4m3" and scheme.scale == "e8m0":
        return None
    if inp is None:
        if fam == "int":
            return None
        if scheme.elem == "e2m1" and scheme.scale == "e4m3":
            return None
        return ("vLLM's MoE runs weight-only experts only as INT (pack-quantized), MXFP4, MXFP8 or NVFP4; FP8 "
                "weights need FP8 inputs there (e.g. w8a8-fp8)")
    if scheme.elem == "e2m1" and scheme.scale == "e4m3":
        return None if inp.elem == "e2m1" else "vLLM's NVFP4 MoE takes NVFP4 inputs or none"
    if fam == "int" and inp.family.name == "int":
        if static:
            return ("vLLM's INT8 fused MoE requires channelwise weights with dynamic per-token inputs (\"For INT8 "
                    "Fused MoE layers, we require channelwise, dynamic per token quantization\"); static per-expert "
                    "input scales are refused there (use w8a8 with dynamic int8 inputs)")
        if scheme.bits == 8 and scheme.group_size != -1:
            return "vLLM's INT8 fused MoE requires per-row (channelwise) weights"
        return None if scheme.bits in (4, 8) else "vLLM's MoE takes INT8 inputs with INT4 or INT8 weights only"
    if scheme.elem == "e4m3" and inp.family.name != "int":
        return None
    if fam == "int" and scheme.bits == 4 and inp.elem == "e4m3" and not static:
        return None
    return f"vLLM's compressed-tensors MoE has no method for {scheme.name} weights with {inp.name} inputs"


def routers(model: nn.Module) -> list[str]:
    """The routers (and shared-expert gates) beside each quantized experts module, which the file lists in ``ignore``.

    Found by structure, as the accounting does: in the block holding the experts, a child whose own 2-D weight
    has one row per expert (the top-k router, a bare Parameter in transformers 5) or one row (Qwen2-MoE's
    ``shared_expert_gate``, a Linear).
    """
    from lowbit.nn.quant_experts import QuantExperts

    out = []
    for bname, block in model.named_modules():
        experts = [c for c in block.children() if isinstance(c, QuantExperts)]
        if not experts:
            continue
        counts = {s.num_experts for c in experts for s in c.stacks().values()}
        for cname, child in block.named_children():
            w = getattr(child, "weight", None)
            if child not in experts and isinstance(w, torch.Tensor) and w.dim() == 2 and (
                    w.shape[0] in counts or w.shape[0] == 1):
                out.append(f"{bname}.{cname}" if bname else cname)
    return out


# ------------------------------------------------------------------ the tensors
def rows(q: QTensor, start: int, stop: int) -> QTensor:
    """Rows ``[start, stop)`` of an INT / FP quantized matrix (groups run along the input, so they stay whole)."""
    return QTensor(q.codes[start:stop], q.scales[start:stop], None if q.zeros is None else q.zeros[start:stop],
                   q.tensor_scale, (stop - start, q.shape[1]), q.scheme)


def expert_parts(stack_name: str, q: QTensor, e: int, layout: Layout) -> Iterator[tuple[str, QTensor, str]]:
    """(checkpoint module name, matrix, role) of expert ``e`` of the fused parameter ``stack_name``; role is
    ``gate_up`` or ``down`` (which input scale it takes)."""
    module, _, param = stack_name.rpartition(".")
    base = f"{layout.key(module)}.{e}"
    if param == GATE_UP:
        half = q.shape[0] // 2
        yield f"{base}.{layout.gate}", rows(q, 0, half), GATE_UP
        yield f"{base}.{layout.up}", rows(q, half, q.shape[0]), GATE_UP
    else:
        yield f"{base}.{layout.down}", q, DOWN


def per_expert_amax(stack: nn.Module) -> tuple[InputScheme | None, torch.Tensor | None]:
    """The input scheme of a stack and its calibrated abs-max per expert (``[E]``), when it quantizes inputs.

    A `QuantStack` that quantizes inputs carries ``input_scheme`` and, for static schemes, ``input_amax``
    (one calibrated abs-max per expert, `QuantStack.with_input`).
    """
    scheme = getattr(stack, "input_scheme", None)
    amax = getattr(stack, "input_amax", None)
    if scheme is None or amax is None:
        return scheme, None
    a = amax.detach().float().reshape(-1)
    if a.numel() != stack.num_experts:
        raise SchemeError(f"experts input abs-max holds {a.numel()} values for {stack.num_experts} experts")
    return scheme, a


# ------------------------------------------------------------------ reading back
_KEY = re.compile(r"^(?P<module>.+\.experts)\.(?P<e>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.(?P<part>[a-z_]+)$")


def expert_keys(keys: list[str], layout: Layout) -> dict[str, dict[int, dict[str, dict[str, str]]]]:
    """Checkpoint experts module -> expert -> projection -> part -> key, for the per-expert keys of a file."""
    projs = {layout.gate, layout.up, layout.down}
    out: dict[str, dict[int, dict[str, dict[str, str]]]] = {}
    for k in keys:
        m = _KEY.match(k)
        if m and m["proj"] in projs:
            out.setdefault(m["module"], {}).setdefault(int(m["e"]), {}).setdefault(m["proj"], {})[m["part"]] = k
    return out


def model_name(key: str, layout: Layout) -> str:
    """A checkpoint module name as the model in memory has it (Mixtral's ``block_sparse_moe`` -> ``mlp``)."""
    return key if layout.block == "mlp" else key.replace(f".{layout.block}.", ".mlp.")


def check_count(module: str, experts: Mapping[int, object], count: int) -> None:
    if sorted(experts) != list(range(count)):
        raise CheckpointError(f"{module}: the file holds experts {sorted(experts)[:4]}... ({len(experts)}) but the "
                              f"config declares {count}; the file is damaged or belongs to another model")
