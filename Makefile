# Convenience wrappers; the README's two commands need only Python (python3 tasks.py run|test).
.PHONY: run test lint bench
run:
	python3 tasks.py run
test:
	python3 tasks.py test
lint:
	.venv/bin/ruff check meshrun models tests bench examples tasks.py && .venv/bin/ruff format --check meshrun models tests bench examples tasks.py
bench:
	.venv/bin/python bench/pipeline.py && .venv/bin/python bench/train.py
