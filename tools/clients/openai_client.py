"""The official `openai` Python package pointed at brume through base_url.

    python tools/clients/openai_client.py --base-url http://127.0.0.1:7860/v1 [--api-key TOKEN]

Lists models, generates two pictures, edits one with a mask whose alpha 0 marks
the area to repaint; every picture must decode and carry its recipe.
"""

import argparse
import base64

import openai
from openai import OpenAI

from common import check_png, fail, test_png


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", default="unused")
    a = ap.parse_args()
    client = OpenAI(base_url=a.base_url, api_key=a.api_key, max_retries=0, timeout=300)
    print(f"openai {openai.__version__} -> {a.base_url}")

    ids = [m.id for m in client.models.list().data]
    if not ids:
        fail("models.list() is empty")
    print(f"models.list(): {ids}")
    model = ids[0]

    r = client.images.generate(model=model, prompt="a red circle on a blue background", n=2, size="128x128", response_format="b64_json")
    if len(r.data) != 2:
        fail(f"images.generate n=2 gave {len(r.data)} pictures")
    for i, d in enumerate(r.data):
        _, text = check_png(d.b64_json, f"generate[{i}]", (128, 128))
    print(f"images.generate: 2 pictures 128x128 with their recipe ({sorted(text)})")

    # The SDK's own defaults (no size, no response_format) must work too.
    r = client.images.generate(model=model, prompt="a big green square", n=1, response_format="b64_json")
    check_png(r.data[0].b64_json, "generate default size")

    image = test_png(128)
    mask = test_png(128, alpha_hole=True)
    r = client.images.edit(
        model=model,
        image=("image.png", image, "image/png"),
        mask=("mask.png", mask, "image/png"),
        prompt="a yellow star",
        n=1,
        size="128x128",
        response_format="b64_json",
    )
    if len(r.data) != 1:
        fail(f"images.edit gave {len(r.data)} pictures")
    check_png(r.data[0].b64_json, "edit", (128, 128))
    print("images.edit: 1 picture 128x128 with its recipe")

    # A bad request surfaces as the SDK's own error type, with a message.
    try:
        client.images.generate(model=model, prompt="x", n=1, size="12x12", response_format="b64_json")
        fail("size 12x12 was accepted")
    except openai.APIStatusError as e:
        if not 400 <= e.status_code < 500:
            fail(f"bad size answered {e.status_code}")
        print(f"bad size -> {e.status_code} {type(e).__name__}: {str(e)[:120]}")
    print("OK")


if __name__ == "__main__":
    main()
