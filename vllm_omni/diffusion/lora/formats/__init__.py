"""Adapter file layouts (PEFT, diffusers, ComfyUI, kohya/A1111) and their mapping onto a model's layers.

* :mod:`.layouts`: layout detection, key normalisation (``lora_down``/``lora_up``) and the tensor checks
  that refuse what cannot be applied exactly (DoRA, bias, modules_to_save, quantised tensors, ...);
* :mod:`.lycoris`: LoHa / LoKr modules (peft ``LoHaConfig`` / ``LoKrConfig``, LyCORIS / kohya files) read into
  their exact LoRA-equivalent factors, and the refusals of what is not applied (Tucker cores, DoRA-like keys);
* :mod:`.model_keys`: at bind time, diffusers' key converter for the model family or generic kohya
  un-flattening against the model's own module names.

The readers themselves are in :mod:`..safetensors_format` (PEFT directories and single files, scaling
rules in :mod:`..peft_format`); :mod:`..loading` picks one by path. See ``docs/user_guide/lora_formats.md``.
"""
