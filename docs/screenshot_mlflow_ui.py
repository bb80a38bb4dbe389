"""Screenshot a search in the MLflow UI: its runs (the parent expanded to its trials, with their data set), the best
trial's page (its logged and registered model, data set, source and tags), its system metrics and the search's
results table.

Used for the README (docs/img/mlflow-ui-*.png). Needs a browser, which the project does not install: Debian's
``chromium`` and ``pip install playwright`` (its Python driver only; no browser download). With ``distmis ui``
serving on 127.0.0.1:5000:

    python docs/screenshot_mlflow_ui.py --experiment quickstart --out-dir docs/img

writes ``mlflow-ui-quickstart.png`` (the runs), ``mlflow-ui-model.png`` (the run of the version the registry's alias
``best`` names), ``mlflow-ui-system-metrics.png`` (that run's "System metrics" tab) and ``mlflow-ui-results.png``
(the search run's ``results.md``).
"""

from __future__ import annotations

import argparse
import json
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def api(url: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """One call of MLflow's REST API (GET with query parameters, or POST ``body``)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/api/2.0/mlflow/{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:5000")
    parser.add_argument("--experiment", default="quickstart")
    parser.add_argument("--model", default=None, help="registered model name (default: the experiment's)")
    parser.add_argument("--out-dir", default=".")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    out = Path(args.out_dir)

    query = urllib.parse.urlencode({"experiment_name": args.experiment})
    experiment_id = api(args.url, f"experiments/get-by-name?{query}")["experiment"]["experiment_id"]
    runs = api(args.url, "runs/search", {"experiment_ids": [experiment_id], "max_results": 1,
                                         "filter": "tags.`distmis.role` = 'search'",
                                         "order_by": ["attributes.start_time DESC"]})["runs"]
    search_run = runs[0]["info"]["run_id"]
    alias = urllib.parse.urlencode({"name": args.model or args.experiment, "alias": "best"})
    best_run = api(args.url, f"registered-models/alias?{alias}")["model_version"]["run_id"]
    base = f"{args.url}/#/experiments/{experiment_id}"

    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, headless=True, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1900, "height": 1100})

        def settle(text: str) -> None:
            page.wait_for_selector(f"text={text}", timeout=60_000)
            page.wait_for_timeout(2500)
            for close in page.locator("button[data-component-id='mlflow.assistant.chat_panel.close']").all():
                close.click()  # the assistant panel on the right
            page.wait_for_timeout(500)

        page.goto(f"{base}/runs")
        settle("matching runs")
        # The parent run of each search folds its trials (child runs) under an expander: open them all.
        for button in page.locator("button[data-component-id$='runnamecellrenderer.tsx_46']").all():
            button.click()
        page.wait_for_selector("text=lr=0.005 norm=group", timeout=30_000)
        page.wait_for_timeout(1500)
        page.screenshot(path=str(out / "mlflow-ui-quickstart.png"), clip={"x": 0, "y": 0, "width": 1500, "height": 420})

        page.goto(f"{base}/runs/{best_run}")
        settle("Registered models")
        page.fill("input[placeholder='Search metrics']", "test_")  # its test scores, below its system metrics
        page.wait_for_timeout(1000)
        page.screenshot(path=str(out / "mlflow-ui-model.png"), clip={"x": 0, "y": 0, "width": 1900, "height": 800})

        page.goto(f"{base}/runs/{best_run}/system-metrics")
        settle("rank0_cpu_utilization_percentage")
        page.screenshot(path=str(out / "mlflow-ui-system-metrics.png"),
                        clip={"x": 0, "y": 0, "width": 1900, "height": 900})

        page.goto(f"{base}/runs/{search_run}/artifacts/results.md")
        settle("best_val_dice")
        page.screenshot(path=str(out / "mlflow-ui-results.png"), clip={"x": 0, "y": 0, "width": 1700, "height": 520})
        browser.close()
    print(f"wrote {out}/mlflow-ui-quickstart.png, mlflow-ui-model.png, mlflow-ui-system-metrics.png, "
          "mlflow-ui-results.png")


if __name__ == "__main__":
    main()
