"""The request sequences Open WebUI and SillyTavern send to an AUTOMATIC1111
server, replayed against brume with `requests`.

    python tools/clients/a1111_clients.py --base-url http://127.0.0.1:7860 [--auth user:TOKEN]

Open WebUI (backend/open_webui/routers/images.py, automatic1111 engine):
verify URL (GET options), list models (GET sd-models: title, model_name),
read the model (GET options), set it (GET options, then POST the whole options
object back with sd_model_checkpoint changed), txt2img with its payload
(prompt, batch_size, width, height, steps, negative_prompt plus the admin's
AUTOMATIC1111_PARAMS), images decoded from base64 and `info` kept.

SillyTavern (src/endpoints/stable-diffusion.js, the `auto` source): ping
(GET options), upscalers (upscalers + latent-upscale-modes), vaes (sd-vae /
sd-modules, either may answer), samplers, schedulers, models, get-model,
set-model (POST options, then poll progress until progress 0 and job_count 0),
generate (GET options for forge_preset, then POST txt2img with the UI's whole
body, url and auth included), progress polling while it runs, and interrupt
(what SillyTavern sends when the user stops or the socket closes).

Every picture must decode and carry its recipe.
"""

import argparse
import base64
import json
import threading
import time

import requests

from common import check_png, fail, test_png


class Client:
    def __init__(self, base, auth):
        self.base = base.rstrip("/")
        self.s = requests.Session()
        # Both clients send HTTP Basic built from "user:password"; Open WebUI sends
        # an empty Authorization header when none is configured.
        if auth:
            self.s.headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
        else:
            self.s.headers["authorization"] = ""

    def get(self, path, **kw):
        r = self.s.get(self.base + path, timeout=300, **kw)
        if r.status_code != 200:
            fail(f"GET {path}: {r.status_code} {r.text[:300]}")
        return r.json()

    def post(self, path, body, ok=200):
        r = self.s.post(self.base + path, json=body, timeout=300)
        if r.status_code != ok:
            fail(f"POST {path}: {r.status_code} {r.text[:300]}")
        return r.json()


def open_webui(c):
    print("-- Open WebUI")
    c.get("/sdapi/v1/options")  # verify_url
    models = [{"id": m["title"], "name": m["model_name"]} for m in c.get("/sdapi/v1/sd-models")]
    if not models:
        fail("sd-models is empty")
    print(f"models: {models}")
    current = c.get("/sdapi/v1/options")["sd_model_checkpoint"]
    print(f"current model: {current}")
    # set_image_model: the whole options object goes back with the model changed
    # (here to the bare name, which differs from the title the server reports).
    for want in (models[0]["name"], models[0]["id"]):
        options = c.get("/sdapi/v1/options")
        if want != options["sd_model_checkpoint"]:
            options["sd_model_checkpoint"] = want
            c.post("/sdapi/v1/options", options)
    after = c.get("/sdapi/v1/options")["sd_model_checkpoint"]
    if after != models[0]["id"]:
        fail(f"after setting {models[0]['id']} the server reports {after}")
    params = {"cfg_scale": 7, "sampler_name": "Euler a", "scheduler": "Automatic"}  # AUTOMATIC1111_PARAMS
    data = {"prompt": "a lighthouse at dusk", "batch_size": 2, "width": 128, "height": 128, "steps": 4, "negative_prompt": "blurry", **params}
    res = c.post("/sdapi/v1/txt2img", data)
    images = res["images"]
    if len(images) != 2:
        fail(f"batch_size 2 gave {len(images)} pictures")
    for i, im in enumerate(images):
        check_png(im, f"open-webui txt2img[{i}]", (128, 128))
    info = json.loads(res["info"])
    if info.get("all_prompts", [None])[0] != data["prompt"]:
        fail(f"info does not echo the prompt: {info}")
    print(f"txt2img: {len(images)} pictures with their recipe; info seed {info.get('seed')}")


def sillytavern(c):
    print("-- SillyTavern")
    c.get("/sdapi/v1/options")  # ping
    ups = [x["name"] for x in c.get("/sdapi/v1/upscalers")]
    latent = [x["name"] for x in c.get("/sdapi/v1/latent-upscale-modes")]
    print(f"upscalers {ups}, latent {latent}")
    vae_lists = []
    for path in ("/sdapi/v1/sd-vae", "/sdapi/v1/sd-modules"):
        r = c.s.get(c.base + path, timeout=60)
        if r.status_code == 200 and isinstance(r.json(), list):
            vae_lists.append([x.get("model_name") for x in r.json()])
    if not vae_lists:
        fail("neither sd-vae nor sd-modules answered a list")
    samplers = [x["name"] for x in c.get("/sdapi/v1/samplers")]
    schedulers = [x["name"] for x in c.get("/sdapi/v1/schedulers")]
    for want in ("Euler a", "DPM++ 2M", "DDIM"):
        if want not in samplers:
            fail(f"sampler {want} missing: {samplers}")
    print(f"samplers {samplers}; schedulers {schedulers}")
    models = [{"value": x["title"], "text": x["title"]} for x in c.get("/sdapi/v1/sd-models")]
    model = c.get("/sdapi/v1/options")["sd_model_checkpoint"]  # get-model
    # set-model, then wait for the "load" as SillyTavern does.
    c.post("/sdapi/v1/options", {"sd_model_checkpoint": models[0]["value"]})
    for _ in range(10):
        p = c.get("/sdapi/v1/progress")
        if p["progress"] == 0.0 and p["state"]["job_count"] == 0:
            break
        time.sleep(0.2)
    else:
        fail(f"progress never idle after set-model: {p}")

    # generate: the UI's whole body, forwarded with url and auth.
    options = c.get("/sdapi/v1/options")
    is_forge = "forge_preset" in options
    body = {
        "url": c.base, "auth": "",
        "prompt": "a cat wearing a hat, masterpiece", "negative_prompt": "lowres, bad anatomy",
        "sampler_name": "DPM++ 2M", "scheduler": "Karras", "steps": 12, "cfg_scale": 7,
        "width": 128, "height": 128, "restore_faces": False, "enable_hr": False,
        "hr_upscaler": "Latent", "hr_scale": 2, "hr_additional_modules": [], "denoising_strength": 0.7,
        "hr_second_pass_steps": 0, "seed": -1,
        "override_settings": {"CLIP_stop_at_last_layers": 1}, "override_settings_restore_afterwards": True,
        "clip_skip": 1, "save_images": True, "send_images": True, "do_not_save_grid": False, "do_not_save_samples": False,
    }
    if not is_forge:
        body["override_settings"].pop("forge_additional_modules", None)
    result = {}

    def generate(b, key):
        result[key] = c.s.post(c.base + "/sdapi/v1/txt2img", json=b, timeout=600)

    t = threading.Thread(target=generate, args=(body, "gen"))
    t.start()
    polls, seen_progress, seen_image = 0, 0.0, False
    while t.is_alive():
        p = c.get("/sdapi/v1/progress", params={"skip_current_image": "false"})
        polls += 1
        for k in ("progress", "eta_relative", "state", "textinfo"):
            if k not in p:
                fail(f"progress lacks {k}: {p}")
        seen_progress = max(seen_progress, p["progress"])
        seen_image = seen_image or bool(p.get("current_image"))
        time.sleep(0.05)
    t.join()
    r = result["gen"]
    if r.status_code != 200:
        fail(f"generate: {r.status_code} {r.text[:300]}")
    data = r.json()
    img, _ = check_png(data["images"][0], "sillytavern txt2img", (128, 128))
    print(f"generate: picture with its recipe; {polls} progress polls, max progress {seen_progress:.2f}, preview seen {seen_image}")
    if seen_progress <= 0.0:
        fail("progress never moved while generating")

    # interrupt: stop a long generation half-way.
    long = dict(body, steps=150, prompt="a very long render")
    t = threading.Thread(target=generate, args=(long, "long"))
    t.start()
    deadline = time.time() + 120
    while time.time() < deadline:
        p = c.get("/sdapi/v1/progress")
        if p["progress"] > 0.05:
            break
        time.sleep(0.05)
    else:
        fail(f"the long job never progressed: {p}")
    c.post("/sdapi/v1/interrupt", {})
    t0 = time.time()
    t.join(timeout=60)
    if t.is_alive():
        fail("txt2img did not return within 60 s of interrupt")
    r = result["long"]
    if r.status_code != 200:
        fail(f"interrupted txt2img answered {r.status_code} {r.text[:200]}")
    print(f"interrupt: txt2img returned {time.time() - t0:.2f} s later with {len(r.json().get('images', []))} picture(s)")
    for im in r.json().get("images", []):
        check_png(im, "interrupted txt2img")
    p = c.get("/sdapi/v1/progress")
    if p["state"]["job_count"] != 0:
        fail(f"progress not idle after interrupt: {p}")

    # img2img with a mask, as the A1111 API takes it.
    init = base64.b64encode(test_png(128)).decode()
    mask = base64.b64encode(test_png(128, alpha_hole=False)).decode()
    res = c.post("/sdapi/v1/img2img", {
        "prompt": "a blue moon", "init_images": [init], "mask": mask, "denoising_strength": 0.6,
        "inpainting_mask_invert": 0, "mask_blur": 4, "steps": 6, "cfg_scale": 7, "sampler_name": "Euler a",
        "width": 128, "height": 128, "seed": 7,
    })
    check_png(res["images"][0], "img2img with mask", (128, 128))
    print("img2img with a mask: picture with its recipe")
    # png-info reads the recipe back.
    pi = c.post("/sdapi/v1/png-info", {"image": "data:image/png;base64," + res["images"][0]})
    if "a blue moon" not in pi.get("info", ""):
        fail(f"png-info does not read the recipe: {pi}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--auth", default="")
    a = ap.parse_args()
    c = Client(a.base_url, a.auth)
    open_webui(c)
    sillytavern(c)
    print("OK")


if __name__ == "__main__":
    main()
