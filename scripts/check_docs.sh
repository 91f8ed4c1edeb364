#!/usr/bin/env bash
# The docs site (mkdocs.yml, docs/) builds with no warning: a broken link or anchor fails it.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$site"
echo "docs: mkdocs build --strict OK"
