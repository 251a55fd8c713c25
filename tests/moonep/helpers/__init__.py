"""What several moonep tests share: problem builders (*_case.py, *_cases.py), independent references
(*_reference.py) and Triton's interpreter with its shims (triton_interpreted.py). No tests here."""
