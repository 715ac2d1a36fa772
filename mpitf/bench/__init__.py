"""``mpitf bench``: run the benchmark suites, validate the cost model, write the report; plan.

Holds the suites ``fabric``, ``pushpull``, ``scaling``, ``modes`` and ``kernels`` (each
runnable with ``python -m``), ``runner`` (the suites under the launcher), ``costmodel``
(the model, pure), ``validation`` (the model against every measured point), ``planner``
(``mpitf bench --plan``) and ``report`` (markdown and plots). May import anything below it.
"""
