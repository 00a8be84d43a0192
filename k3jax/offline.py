"""Offline inference for notebooks and scripts, in the spirit of vLLM's `LLM`:

    from k3jax import LLM, SamplingParams
    llm = LLM(model="tiny", max_num_seqs=8)
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=16))
    outs[0].outputs[0].text, outs[0].num_cached_tokens

Images (models with a vision tower): chat messages with image parts (data URLs or local paths),

    llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "cat.png"}},
                                            {"type": "text", "text": "What is this?"}]}])

or a prompt dict {"prompt": text or "prompt_token_ids": ids, "multi_modal_data": {"image": [...]}}
whose text holds one `<|media_pad|>` per image (PIL images or sources).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence, Union

from serving.engine import LLMEngine
from serving.engine_args import EngineArgs, field_default
from serving.request import RequestOutput
from serving.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineArgs"]

Prompt = Union[str, Sequence[int], dict]


class LLM:
    def __init__(self, model="tiny", *, dtype=None, mesh=None, revision=None, download_dir=None, **engine_args):
        """model: a preset name, a checkpoint directory, a Hugging Face model id (ORG/NAME, at `revision`,
        cached under `download_dir`) or a loaded k3jax Model. mesh: a jax Mesh or a spec like
        "data=2,expert=4" (parameters, pools and MoE sharded on it). engine_args: EngineArgs' fields,
        the advanced kernel and layout choices included (kernels, mla_prefill, mla_decode, merged_experts:
        applied when the model loads, so a loaded Model keeps its own)."""
        from k3jax.api import Model, load_model
        engine_args = EngineArgs(**engine_args)       # checked before a model loads
        if isinstance(model, Model):
            chosen = {k: v for k, v in engine_args.load_options().items() if v != field_default(k)}
            if chosen:
                raise ValueError(f"{', '.join(chosen)}: chosen when a model loads; pass them to load_model, "
                                 "or a model name to LLM")
            self.model = model
        else:
            self.model = load_model(model, dtype=dtype, mesh=mesh, revision=revision, download_dir=download_dir,
                                    **engine_args.load_options())
        self.engine = LLMEngine(self.model, engine_args, load_model=load_model)
        self._calls = 0

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]], sampling_params=None, *,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); n > 1 gives n completions per prompt.
        A prompt the engine refuses (ValueError), or an interrupt, leaves no request of the call queued."""
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        elif not (isinstance(sampling_params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in sampling_params)):
            raise TypeError(f"sampling_params: expected a SamplingParams or a list of them, got {type(sampling_params).__name__}")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
        self._calls += 1            # request ids unique per call
        groups, added = [], []
        final: dict[str, RequestOutput] = {}
        bar = None
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, sampling_params)):
                tokens, images = self._split(prompt)
                ids = []
                for j in range(sp.n):
                    ids.append(self.engine.add_request(tokens, sp.for_child(j), images=images,
                                                       request_id=f"offline-{id(self)}-{self._calls}-{i}-{j}"))
                    added.append(ids[-1])
                groups.append((prompt, ids))
            if use_tqdm:
                from tqdm import tqdm
                bar = tqdm(total=len(added), desc="generating", unit="seq")
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            for rid in added:
                if rid not in final:
                    self.engine.abort(rid)
            if bar is not None:
                bar.close()
        results = []
        for prompt, ids in groups:
            outs = [final[r] for r in ids]
            comps = [dataclasses.replace(o.outputs[0], index=j) for j, o in enumerate(outs)]
            text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
            results.append(RequestOutput(ids[0].rsplit("-", 1)[0], text,
                                         outs[0].prompt_token_ids, comps, True, outs[0].num_cached_tokens,
                                         outs[0].metrics))
        return results

    def chat(self, messages, sampling_params=None, **template_kwargs) -> RequestOutput:
        """One chat completion; messages are checked as the server checks them (ValueError naming the
        bad field)."""
        from pydantic import TypeAdapter
        from serving.openai.protocol import ChatMessage
        messages = [m.model_dump(exclude_unset=True) for m in TypeAdapter(list[ChatMessage]).validate_python(messages)]
        if not messages:
            raise ValueError("messages: at least one message is needed")
        ids = self.model.tokenizer.apply_chat_template(messages, tokenize=True, **template_kwargs)
        from serving.openai.chat import image_sources
        images = [src for _, _, src in image_sources(messages)]
        prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids
        return self.generate([prompt], sampling_params)[0]

    def _split(self, prompt):
        """(text or token ids, [ImageInput]) of one prompt."""
        if not isinstance(prompt, dict):
            return prompt, ()
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
        items = (prompt.get("multi_modal_data") or {}).get("image", [])
        items = items if isinstance(items, (list, tuple)) else [items]
        tokens = prompt.get("prompt_token_ids")
        if tokens is None:       # placeholders are special tokens: parse them in the text
            if self.model.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer; pass prompt_token_ids")
            tokens = self.model.tokenizer.encode(prompt["prompt"], allow_special=bool(items))
        return tokens, [self._image(x) for x in items]

    def _image(self, item):
        if self.model.vision is None:
            raise ValueError("images: this model has no vision tower")
        from serving.image_inputs import ImageLoader
        loader = ImageLoader(self.model.vision)
        if isinstance(item, str):
            return loader.load(item)
        from k3jax.vision.media import image_digest, to_rgb
        rgb = to_rgb(item)
        return loader.from_pil(rgb, image_digest(rgb))


def _prompt_list(prompts) -> list:
    """One prompt (text, token ids, or a prompt dict) or a list of them -> a list of prompts."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                             and isinstance(prompts[0], int)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts: expected text, token ids, a prompt dict or a list of them, "
                        f"got {type(prompts).__name__}")
    return list(prompts)
