"""Take the README's screenshots of the built-in page: the chat (light theme) and the token view (dark theme).

Needs headless Chromium and its driver (`apt-get install chromium chromium-driver`) and selenium; shrinks the
PNGs with pngquant when it is installed. Run from the repository root:

    PYTHONPATH=$PWD python scripts/webui_screenshots.py [docs]
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from outrider_tools.server_process import ServerProcess

PROMPT = "Write a function that checks whether a string is a palindrome"


def browser(dark: bool) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=880,640",
                "--hide-scrollbars"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))
    if dark:
        driver.execute_cdp_cmd("Emulation.setEmulatedMedia",
                               {"features": [{"name": "prefers-color-scheme", "value": "dark"}]})
    return driver


def chat(driver: webdriver.Chrome, url: str) -> None:
    """A fresh page with one finished reply (greedy, so both screenshots show the same one)."""
    driver.get(url)
    driver.execute_script("localStorage.clear(); localStorage.setItem('outrider.webui.settings',"
                          "JSON.stringify({temperature: 0, max_tokens: 120, seed: 1}))")
    driver.get(url)
    driver.find_element(By.ID, "input").send_keys(PROMPT)
    driver.find_element(By.ID, "send").click()
    wait = WebDriverWait(driver, 120, poll_frequency=0.1)
    wait.until(lambda d: d.find_element(By.ID, "stop").is_displayed())
    wait.until(lambda d: d.find_element(By.ID, "send").is_displayed())
    time.sleep(2.5)  # two /metrics samples: the strip shows a rate


def shoot(driver: webdriver.Chrome, path: Path) -> None:
    driver.save_screenshot(str(path))
    if shutil.which("pngquant"):
        subprocess.run(["pngquant", "--force", "--skip-if-larger", "--strip", "--output", str(path), "32",
                        str(path)], check=False)
    print(f"{path}: {path.stat().st_size // 1024} KB")


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs")
    server = ServerProcess(["--demo-draft", "mtp", "--metrics", "-np", "4", "-c", "1024"])
    try:
        for dark, name in ((False, "webui-chat.png"), (True, "webui-tokens.png")):
            driver = browser(dark)
            try:
                chat(driver, server.url + "/")
                if dark:
                    driver.find_element(By.ID, "token-view").click()
                    time.sleep(0.3)
                shoot(driver, out / name)
            finally:
                driver.quit()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
