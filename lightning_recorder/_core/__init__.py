"""The private foundation every room stands on (torch only; nothing here imports Lightning).

* :mod:`.names` — module and parameter names: wrapper prefixes, globs, types.
* :mod:`.checks` — argument checks and the closest-name messages.
* :mod:`.structures` — call arguments in signature order, paths into outputs, tensor maps,
  in-place detection.
* :mod:`.hooks` — hook ownership (:class:`~.hooks.HookSet`) and the one hook base
  (:class:`~.hooks.WeakHook`: weakly bound, inert when copied, silent in checkpoint re-runs).
* :mod:`.patching` — shared, reference-counted patches of functions and methods.
* :mod:`.registry` — named types (recorders, deliveries, losses) and named groups.
* :mod:`.compat` — every read of torch's private state.
"""
