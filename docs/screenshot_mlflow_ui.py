"""Screenshot an experiment's runs in the MLflow UI, with the search's parent run expanded to its trials.

Used for the README walk-through (docs/img/mlflow-ui-quickstart.png). Needs a browser, which the project
does not install: Debian's ``chromium`` and ``pip install playwright`` (its Python driver only; no browser
download). With ``distmis ui`` serving on 127.0.0.1:5000:

    python docs/screenshot_mlflow_ui.py --experiment quickstart --out docs/img/mlflow-ui-quickstart.png
"""

from __future__ import annotations

import argparse
import json
import urllib.parse
import urllib.request

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:5000")
    parser.add_argument("--experiment", default="quickstart")
    parser.add_argument("--out", default="mlflow-ui.png")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()

    query = urllib.parse.urlencode({"experiment_name": args.experiment})
    with urllib.request.urlopen(f"{args.url}/api/2.0/mlflow/experiments/get-by-name?{query}", timeout=30) as r:
        experiment_id = json.load(r)["experiment"]["experiment_id"]

    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, headless=True, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1600, "height": 900})
        page.goto(f"{args.url}/#/experiments/{experiment_id}/runs")
        page.wait_for_selector("text=matching runs", timeout=60_000)
        # The parent run of each search folds its trials (child runs) under an expander: open them all.
        for button in page.locator("button[data-component-id$='runnamecellrenderer.tsx_46']").all():
            button.click()
        page.wait_for_timeout(1500)
        # The left part: navigation and the runs table (the assistant panel on the right is left out).
        page.screenshot(path=args.out, clip={"x": 0, "y": 0, "width": 1190, "height": 470})
        browser.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
