"""The peers' side of `brume bench speed`: PyTorch, ONNX Runtime and OpenVINO.

Started by the benchmark with a work folder; it then sends one JSON request per line
on stdin and reads one JSON answer per line on stdout:

  {"cmd": "load", "name": N, "kind": "unet"|"vae_decoder"|"tiny_decoder"|"text_encoder",
   "model": DIR, "subfolder": S, "inputs": [[file, shape, dtype], ...], "variants": [...]}
      -> {"variants": [...ready...], "skipped": {variant: why}, "flops": F, "precision": {variant: what ran}}
  {"cmd": "run", "name": N, "variant": V}  -> {"s": seconds}
  {"cmd": "unload", "name": N}             -> {}
  {"cmd": "quit"}

Every variant runs the same module, loaded by diffusers / transformers from the model
folder brume loads, on the inputs brume wrote (raw little-endian files). The first run
of each variant writes its output to <work>/<name>.<variant>.f32 so brume can measure
its error against PyTorch f32. A variant that cannot be built here (a missing package,
an exporter failure) is reported as skipped with the reason, never silently dropped.
"""

import gc
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

VARIANTS = ["torch-f32", "torch-bf16", "onnxruntime-f32", "openvino-f32", "openvino-bf16"]


def answer(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Wrap(torch.nn.Module):
    """One positional-tensor-in, one-tensor-out view of a component, for every runtime."""

    def __init__(self, kind, module):
        super().__init__()
        self.kind, self.m = kind, module

    def forward(self, *xs):
        if self.kind == "unet":
            sample, t, ctx = xs
            return self.m(sample, t, encoder_hidden_states=ctx, return_dict=False)[0]
        if self.kind in ("vae_decoder", "tiny_decoder"):
            return self.m.decode(xs[0], return_dict=False)[0]
        return self.m(input_ids=xs[0], return_dict=False)[0]


def load_module(kind, model, subfolder):
    if kind == "unet":
        from diffusers import UNet2DConditionModel as C
    elif kind == "vae_decoder":
        from diffusers import AutoencoderKL as C
    elif kind == "tiny_decoder":
        from diffusers import AutoencoderTiny as C
    else:
        from transformers import CLIPTextModel as C
    m = C.from_pretrained(model, subfolder=subfolder, torch_dtype=torch.float32)
    return Wrap(kind, m.eval())


def read_inputs(work, specs):
    out = []
    for file, shape, dtype in specs:
        if dtype == "f32":
            a = np.fromfile(work / file, dtype="<f4").reshape(shape)
            out.append(torch.from_numpy(a.copy()))
        else:  # token ids, u32 on brume's side
            a = np.fromfile(work / file, dtype="<u4").reshape(shape).astype(np.int64)
            out.append(torch.from_numpy(a))
    return out


def count_flops(module, inputs):
    from torch.utils.flop_counter import FlopCounterMode

    with torch.inference_mode(), FlopCounterMode(display=False) as fc:
        module(*inputs)
    return int(fc.get_total_flops())


def build(variant, module, inputs, work, name, threads, cache):
    """A zero-argument callable running one forward pass, and what precision it runs.
    `cache` holds what variants of one component share (OpenVINO's converted model)."""
    if variant == "torch-f32":
        return (lambda: module(*inputs)), "f32"
    if variant == "torch-bf16":
        import copy

        m16 = copy.deepcopy(module).to(torch.bfloat16)
        xs = [x.to(torch.bfloat16) if x.is_floating_point() else x for x in inputs]
        return (lambda: m16(*xs).float()), "bf16"
    if variant == "onnxruntime-f32":
        import onnxruntime as ort

        path = work / f"{name}.onnx"
        names = [f"in{i}" for i in range(len(inputs))]
        with torch.inference_mode():
            try:
                torch.onnx.export(module, tuple(inputs), str(path), input_names=names, output_names=["out"],
                                  opset_version=17, dynamo=False, external_data=True)
            except TypeError:
                torch.onnx.export(module, tuple(inputs), str(path), input_names=names, output_names=["out"],
                                  opset_version=17, dynamo=False)
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        feed = {n: x.numpy() for n, x in zip(names, inputs)}
        return (lambda: torch.from_numpy(sess.run(None, feed)[0])), "f32"
    if variant.startswith("openvino-"):
        import openvino as ov

        want = variant.split("-")[1]
        core = ov.Core()
        if "openvino" not in cache:
            with torch.inference_mode():
                cache["openvino"] = ov.convert_model(module, example_input=tuple(inputs))
        om = cache["openvino"]
        cfg = {"INFERENCE_PRECISION_HINT": want, "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
        cm = core.compile_model(om, "CPU", cfg)
        hint = cm.get_property("INFERENCE_PRECISION_HINT")
        got = hint.get_type_name() if hasattr(hint, "get_type_name") else str(hint)
        req = cm.create_infer_request()
        feed = [x.numpy() for x in inputs]

        def run():
            req.infer(feed)
            return torch.from_numpy(np.array(req.get_output_tensor(0).data, copy=True))

        return run, got if got == want else f"{got} (asked {want})"
    raise ValueError(f"unknown variant {variant}")


def versions():
    out = [f"torch {torch.__version__}"]
    for mod in ("onnxruntime", "openvino"):
        try:
            m = __import__(mod)
            out.append(f"{mod} {m.__version__.split('-')[0]}")
        except ImportError:
            out.append(f"{mod} not installed")
    return ", ".join(out)


def main():
    work = Path(sys.argv[1])
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else torch.get_num_threads()
    torch.set_num_threads(threads)
    loaded = {}
    answer({"ready": f"{versions()}, {threads} threads"})
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req["cmd"]
        if cmd == "quit":
            break
        if cmd == "unload":
            loaded.pop(req["name"], None)
            gc.collect()
            answer({})
            continue
        if cmd == "load":
            name = req["name"]
            module = load_module(req["kind"], req["model"], req["subfolder"])
            inputs = read_inputs(work, req["inputs"])
            flops = count_flops(module, inputs)
            runs, skipped, precision, cache = {}, {}, {}, {}
            for v in req["variants"]:
                try:
                    f, what = build(v, module, inputs, work, name, threads, cache)
                    runs[v] = f
                    precision[v] = what
                except Exception as e:  # report, never drop silently
                    skipped[v] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    traceback.print_exc(file=sys.stderr)
            cache.clear()  # compiled models keep their own weights
            gc.collect()
            loaded[name] = dict(runs=runs, written=set())
            answer({"variants": list(runs), "skipped": skipped, "flops": flops, "precision": precision})
            continue
        if cmd == "run":
            entry = loaded[req["name"]]
            v = req["variant"]
            with torch.inference_mode():
                t = time.perf_counter()
                out = entry["runs"][v]()
                dt = time.perf_counter() - t
            if v not in entry["written"]:
                out.float().contiguous().numpy().astype("<f4").tofile(work / f"{req['name']}.{v}.f32")
                entry["written"].add(v)
            answer({"s": dt})
            continue
        answer({"error": f"unknown command {cmd}"})


if __name__ == "__main__":
    main()
