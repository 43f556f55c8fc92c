"""The peers' side of `brume bench speed`: PyTorch, ONNX Runtime, OpenVINO and stable-diffusion.cpp.

Started by the benchmark with a work folder; it then sends one JSON request per line
on stdin and reads one JSON answer per line on stdout:

  {"cmd": "load", "name": N, "kind": "unet"|"vae_decoder"|"tiny_decoder"|"text_encoder"|"image",
   "model": DIR, "subfolder": S, "inputs": [[file, shape, dtype], ...], "variants": [...],
   "steps": n, "guidance": g}   (steps and guidance: for "image", whose inputs are the
                                 prompt's ids, the empty prompt's ids and the initial noise)
      -> {"variants": [...ready...], "skipped": {variant: why}, "flops": F, "precision": {variant: what ran},
          "no_output": {variant: why}}   (variants whose output cannot be compared: see SdCpp)
  {"cmd": "run", "name": N, "variant": V}  -> {"s": seconds}
  {"cmd": "unload", "name": N}             -> {}
  {"cmd": "quit"}

Every variant runs the same module, loaded by diffusers / transformers from the model
folder brume loads, on the inputs brume wrote (raw little-endian files). The first run
of each variant writes its output to <work>/<name>.<variant>.f32 so brume can measure
its error against PyTorch f32. A variant that cannot be built here (a missing package,
an exporter failure) is reported as skipped with the reason, never silently dropped.

stable-diffusion.cpp (PyPI's stable-diffusion-cpp-python, which builds it for this CPU) is
the exception: it loads the same diffusers folder, but it only runs whole generations
from its own noise, so its output is not comparable and each component's time is the
one sd.cpp itself logs for that stage of a generation (see SdCpp).
"""

import ctypes
import gc
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

VARIANTS = ["torch-f32", "torch-bf16", "onnxruntime-f32", "openvino-f32", "openvino-bf16", "sdcpp-f32", "sdcpp-f16", "sdcpp-q8_0"]

# The protocol's channel: the original stdout, kept apart from fd 1, which is pointed at
# stderr so that nothing a library prints (sd.cpp's binding prints to stdout) can
# interleave with an answer.
PROTOCOL = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)


def answer(obj):
    PROTOCOL.write(json.dumps(obj) + "\n")
    PROTOCOL.flush()


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
    f, what = compile_module(variant, module, inputs, work, name, threads, cache)
    return (lambda: f(*inputs)), what


def compile_module(variant, module, example, work, name, threads, cache):
    """`module` as `variant` runs it: a callable on tensors shaped like `example`
    (torch tensors in, an f32 torch tensor out), and what precision it runs."""
    if variant == "torch-f32":
        return module, "f32"
    if variant == "torch-bf16":
        import copy

        m16 = copy.deepcopy(module).to(torch.bfloat16)
        return (lambda *xs: m16(*[x.to(torch.bfloat16) if x.is_floating_point() else x for x in xs]).float()), "bf16"
    if variant == "onnxruntime-f32":
        import onnxruntime as ort

        path = work / f"{name}.onnx"
        names = [f"in{i}" for i in range(len(example))]
        with torch.inference_mode():
            try:
                torch.onnx.export(module, tuple(example), str(path), input_names=names, output_names=["out"],
                                  opset_version=17, dynamo=False, external_data=True)
            except TypeError:
                torch.onnx.export(module, tuple(example), str(path), input_names=names, output_names=["out"],
                                  opset_version=17, dynamo=False)
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        return (lambda *xs: torch.from_numpy(sess.run(None, {n: x.numpy() for n, x in zip(names, xs)})[0])), "f32"
    if variant.startswith("openvino-"):
        import openvino as ov

        want = variant.split("-")[1]
        core = ov.Core()
        if "openvino" not in cache:
            with torch.inference_mode():
                cache["openvino"] = ov.convert_model(module, example_input=tuple(example))
        om = cache["openvino"]
        cfg = {"INFERENCE_PRECISION_HINT": want, "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
        cm = core.compile_model(om, "CPU", cfg)
        hint = cm.get_property("INFERENCE_PRECISION_HINT")
        got = hint.get_type_name() if hasattr(hint, "get_type_name") else str(hint)
        req = cm.create_infer_request()

        def run(*xs):
            req.infer([x.numpy() for x in xs])
            return torch.from_numpy(np.array(req.get_output_tensor(0).data, copy=True))

        return run, got if got == want else f"{got} (asked {want})"
    raise ValueError(f"unknown variant {variant}")


class SdCpp:
    """stable-diffusion.cpp as a peer: `sdcpp-<wtype>` loads the component's model folder
    (its diffusers layout; a tiny VAE folder through `taesd_path`) with weights of that
    type, computed the ggml way (f32 activations; f16 and q8_0 weights go through ggml's
    f16 / 8-bit dot products), with flash attention on (its direct-convolution options
    ran level with its default im2col path on the Zen 3 host: the SDXS UNet at 512 px
    took 7.8-9.0 s all four ways, with and without each).

    It has no entry point per component: every run is a whole generation, and a
    component's time is what sd.cpp logs for its stage of it (the text encoder's
    forward, to the ms; the sampling of one step and the decode, to 10 ms). A
    component's generation is shaped to run that stage as brume's row does: the UNet's
    batch of 2 as one guided step (sd.cpp runs the branches one after the other), 1 as
    one unguided step; images at the latents' size x 8. Its initial noise is its own (it
    takes no latents), so its output is not compared (error "n/a")."""

    # What sd.cpp logs once each stage is done ("<what> completed, taking 1.23s" or
    # "... 850 ms"): the text encoder's forward (its own line, in ms), the sampling of
    # the one step, the decode.
    STAGE = {
        "unet": "sampling",
        "vae_decoder": "decode_first_stage",
        "tiny_decoder": "decode_first_stage",
        "text_encoder": "computing condition graph",
    }
    LOG = []

    @staticmethod
    def spare_taesd(work):
        """A random tiny VAE decoder (diffusers' AutoencoderTiny, TAESD's shape) for the
        runs that time the text encoder or the UNet: sd.cpp decodes every generation, and
        with a KL decoder at 512 px that decode alone takes several times the UNet's step."""
        path = work / "sdcpp-spare-taesd.safetensors"
        if not path.exists():
            from diffusers import AutoencoderTiny
            from safetensors.torch import save_file

            torch.manual_seed(0)
            tmp = path.with_name(path.name + ".tmp")
            save_file({k: v.contiguous() for k, v in AutoencoderTiny().state_dict().items()}, str(tmp))
            tmp.replace(path)
        return str(path)

    def __init__(self, variant, kind, model, inputs, work, threads, steps=1, guidance=0.0):
        import stable_diffusion_cpp as sdc

        if not getattr(SdCpp, "hooked", False):
            # One process-wide log sink: the stage times are read from it.
            SdCpp.callback = sdc.sd_log_callback(lambda level, text, data: SdCpp.LOG.append(text.decode("utf-8", "replace")))
            sdc.sd_set_log_callback(SdCpp.callback, ctypes.c_void_p(0))
            SdCpp.hooked = True
        self.kind = kind
        wtype = variant.split("-", 1)[1]
        vae_config = Path(model) / "vae" / "config.json"
        tiny = vae_config.exists() and json.loads(vae_config.read_text())["_class_name"] == "AutoencoderTiny"
        if tiny:
            taesd = str(Path(model) / "vae" / "diffusion_pytorch_model.safetensors")
        elif kind in ("unet", "text_encoder"):
            taesd = SdCpp.spare_taesd(work)
        else:
            taesd = ""
        self.sd = sdc.StableDiffusion(model_path=str(model), taesd_path=taesd, n_threads=threads, wtype=wtype,
                                      flash_attn=True, verbose=True)
        self.what = "f32" if wtype == "f32" else f"w-{wtype}"
        self.gen = dict(prompt="a photograph of an astronaut riding a horse", seed=42, sample_method="euler")
        if kind == "image":
            noise = inputs[2]
            self.gen.update(width=noise.shape[-1] * 8, height=noise.shape[-2] * 8, sample_steps=steps,
                            cfg_scale=guidance if guidance > 1.0 else 1.0)
        elif kind == "unet":
            sample = inputs[0]
            self.gen.update(width=sample.shape[-1] * 8, height=sample.shape[-2] * 8, sample_steps=1,
                            cfg_scale=7.5 if sample.shape[0] == 2 else 1.0)
        elif kind in ("vae_decoder", "tiny_decoder"):
            latents = inputs[0]
            self.gen.update(width=latents.shape[-1] * 8, height=latents.shape[-2] * 8, sample_steps=1, cfg_scale=1.0)
        else:  # the text encoder: the smallest image its UNet takes
            self.gen.update(width=64, height=64, sample_steps=1, cfg_scale=1.0)

    def run(self):
        """Seconds: the whole generation's for an image, else the component's stage's."""
        SdCpp.LOG.clear()
        t = time.perf_counter()
        self.sd.generate_image(**self.gen)
        wall = time.perf_counter() - t
        if self.kind == "image":
            return wall
        stage = SdCpp.STAGE[self.kind]
        done = re.search(re.escape(stage) + r" completed, taking ([0-9.]+) ?(ms|s)\b", "".join(SdCpp.LOG))
        if done is None:
            raise RuntimeError(f"stable-diffusion.cpp logged no '{stage} completed' line")
        return float(done.group(1)) / (1000.0 if done.group(2) == "ms" else 1.0)

    def close(self):
        self.sd.close()


class Image:
    """A whole txt2img image as brume's `image-*` component runs it: the prompt (and,
    guided, the empty prompt) through the text encoder, `steps` DDIM steps of the UNet
    with classifier-free guidance, the decoder, then [0, 1] as brume writes images.
    Each variant compiles the three modules its own way; the loop is shared."""

    def __init__(self, model, inputs, steps, guidance):
        from diffusers import AutoencoderKL, AutoencoderTiny, DDIMScheduler, UNet2DConditionModel
        from transformers import CLIPTextModel

        self.ids, self.uncond, self.noise = inputs
        self.steps, self.guidance = steps, guidance
        self.guided = guidance > 1.0
        vae_class = json.loads((Path(model) / "vae" / "config.json").read_text())["_class_name"]
        vae = (AutoencoderTiny if vae_class == "AutoencoderTiny" else AutoencoderKL).from_pretrained(
            model, subfolder="vae", torch_dtype=torch.float32).eval()
        self.scale = vae.config.scaling_factor
        self.shift = getattr(vae.config, "shift_factor", None) or 0.0
        self.modules = {
            "text": Wrap("text_encoder", CLIPTextModel.from_pretrained(model, subfolder="text_encoder", torch_dtype=torch.float32).eval()),
            "unet": Wrap("unet", UNet2DConditionModel.from_pretrained(model, subfolder="unet", torch_dtype=torch.float32).eval()),
            "decoder": Wrap("tiny_decoder" if vae_class == "AutoencoderTiny" else "vae_decoder", vae),
        }
        self.scheduler = DDIMScheduler.from_pretrained(model, subfolder="scheduler")
        with torch.inference_mode():
            ctx = self.modules["text"](self.ids)
        batch = 2 if self.guided else 1
        self.examples = {
            "text": [self.ids],
            "unet": [torch.cat([self.noise] * batch), torch.tensor([999.0]), torch.cat([ctx] * batch)],
            "decoder": [self.noise],
        }

    def flops(self):
        per = {k: count_flops(m, self.examples[k]) for k, m in self.modules.items()}
        return per["text"] * (2 if self.guided else 1) + per["unet"] * self.steps + per["decoder"]

    def build(self, variant, work, name, threads):
        parts, whats = {}, set()
        for k, m in self.modules.items():
            f, what = compile_module(variant, m, self.examples[k], work, f"{name}.{k}", threads, {})
            parts[k] = f
            whats.add(what)
        return (lambda: self.run(parts)), "/".join(sorted(whats))

    def run(self, parts):
        cond = parts["text"](self.ids)
        ctx = torch.cat([parts["text"](self.uncond), cond]) if self.guided else cond
        sched = self.scheduler
        sched.set_timesteps(self.steps)
        latents = self.noise * sched.init_noise_sigma
        for t in sched.timesteps:
            x = torch.cat([latents] * 2) if self.guided else latents
            x = sched.scale_model_input(x, t)
            eps = parts["unet"](x, torch.tensor([float(t)]), ctx)
            if self.guided:
                uncond, cond_eps = eps.chunk(2)
                eps = uncond + self.guidance * (cond_eps - uncond)
            latents = sched.step(eps, t, latents).prev_sample
        image = parts["decoder"](latents / self.scale + self.shift)
        return (image / 2 + 0.5).clamp(0, 1)


def versions():
    out = [f"torch {torch.__version__}"]
    for mod in ("onnxruntime", "openvino", "stable_diffusion_cpp"):
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
            for f in loaded.pop(req["name"], {}).get("runs", {}).values():
                if isinstance(f, SdCpp):
                    f.close()
            gc.collect()
            answer({})
            continue
        if cmd == "load":
            name = req["name"]
            inputs = read_inputs(work, req["inputs"])
            if req["kind"] == "image":
                image = Image(req["model"], inputs, req["steps"], req["guidance"])
                flops = image.flops()
                make = lambda v, cache: image.build(v, work, name, threads)  # noqa: E731
            else:
                module = load_module(req["kind"], req["model"], req["subfolder"])
                flops = count_flops(module, inputs)
                make = lambda v, cache: build(v, module, inputs, work, name, threads, cache)  # noqa: E731
            runs, skipped, precision, cache, no_output = {}, {}, {}, {}, {}
            for v in req["variants"]:
                try:
                    if v.startswith("sdcpp-"):
                        peer = SdCpp(v, req["kind"], req["model"], inputs, work, threads, req.get("steps", 1), req.get("guidance", 0.0))
                        runs[v], precision[v] = peer, peer.what
                        no_output[v] = "sd.cpp starts from its own noise"
                        continue
                    f, what = make(v, cache)
                    runs[v] = f
                    precision[v] = what
                except Exception as e:  # report, never drop silently
                    skipped[v] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    traceback.print_exc(file=sys.stderr)
            cache.clear()  # compiled models keep their own weights
            gc.collect()
            loaded[name] = dict(runs=runs, written=set())
            answer({"variants": list(runs), "skipped": skipped, "flops": flops, "precision": precision, "no_output": no_output})
            continue
        if cmd == "run":
            entry = loaded[req["name"]]
            v = req["variant"]
            if isinstance(entry["runs"][v], SdCpp):
                answer({"s": entry["runs"][v].run()})
                continue
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
