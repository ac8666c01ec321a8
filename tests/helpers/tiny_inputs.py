"""Chat messages and images for the tiny VLM."""

from PIL import Image

SYSTEM = "You are a careful problem solver."


def vlm_messages(n_images: int, question: str = "How many steps?"):
    return [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
        {"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": question}]},
    ]


def images(n: int):
    colors = [(0, 170, 0), (220, 0, 0), (30, 90, 255), (60, 60, 60)]
    return [Image.new("RGB", (112, 112), colors[i % 4]) for i in range(n)]
