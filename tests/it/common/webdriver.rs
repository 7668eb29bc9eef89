//! A small W3C WebDriver client over HTTP (ureq), enough to drive Debian's chromium through
//! chromedriver headless: navigate, find, click, type, read text, take screenshots.

use serde_json::{Value, json};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

pub struct Browser {
    driver: Child,
    base: String,
    session: String,
    agent: ureq::Agent,
}

impl Browser {
    /// Starts chromedriver and a headless chromium session, or `None` when they are missing
    /// outside CI (under CI a missing browser fails the test).
    pub fn start() -> Option<Browser> {
        let driver_bin =
            std::env::var("TETHER_CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".into());
        let chrome =
            std::env::var("TETHER_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
        let port = crate::common::pg::free_port();
        let driver = match Command::new(&driver_bin)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
        {
            Ok(c) => c,
            Err(e) => {
                crate::common::missing(
                    &format!("chromedriver ({e})"),
                    ".ci/test installs chromium-driver",
                );
                return None;
            }
        };
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(60)))
            .build()
            .into();
        let base = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = agent
                .get(&format!("{base}/status"))
                .call()
                .ok()
                .and_then(|mut r| r.body_mut().read_to_string().ok())
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                .is_some_and(|v| v["value"]["ready"] == true);
            if ready {
                break;
            }
            assert!(Instant::now() < deadline, "chromedriver did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": chrome, "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1360,1000", "--hide-scrollbars"]}
        }}});
        let mut b = Browser {
            driver,
            base,
            session: String::new(),
            agent,
        };
        let v = b.call("POST", "/session", Some(caps));
        b.session = v["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no WebDriver session: {v}"))
            .to_string();
        Some(b)
    }

    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}{path}", self.base);
        let resp = match (method, body) {
            ("GET", _) => self.agent.get(&url).call(),
            ("DELETE", _) => self.agent.delete(&url).call(),
            (_, b) => self
                .agent
                .post(&url)
                .header("Content-Type", "application/json")
                .send(b.unwrap_or_else(|| json!({})).to_string()),
        };
        let mut resp = resp.unwrap_or_else(|e| panic!("WebDriver {method} {path}: {e}"));
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        if v["value"]["error"].is_string() {
            panic!("WebDriver {method} {path}: {}", v["value"]);
        }
        v
    }

    fn s(&self, rest: &str) -> String {
        format!("/session/{}{rest}", self.session)
    }

    pub fn open(&self, url: &str) {
        self.call("POST", &self.s("/url"), Some(json!({"url": url})));
    }

    /// The element the CSS selector finds (waiting up to 10 s for it to appear).
    pub fn find(&self, css: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let v = self.call(
                "POST",
                &self.s("/elements"),
                Some(json!({"using": "css selector", "value": css})),
            );
            if let Some(e) = v["value"].as_array().and_then(|a| a.first()) {
                return e[ELEMENT]
                    .as_str()
                    .unwrap_or_else(|| panic!("no element id in {e}"))
                    .to_string();
            }
            assert!(
                Instant::now() < deadline,
                "no element {css:?} on {}",
                self.url()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn count(&self, css: &str) -> usize {
        let v = self.call(
            "POST",
            &self.s("/elements"),
            Some(json!({"using": "css selector", "value": css})),
        );
        v["value"].as_array().map_or(0, Vec::len)
    }

    pub fn click(&self, css: &str) {
        let e = self.find(css);
        self.call("POST", &self.s(&format!("/element/{e}/click")), None);
    }

    pub fn type_in(&self, css: &str, text: &str) {
        let e = self.find(css);
        self.call("POST", &self.s(&format!("/element/{e}/clear")), None);
        self.call(
            "POST",
            &self.s(&format!("/element/{e}/value")),
            Some(json!({"text": text})),
        );
    }

    pub fn text(&self, css: &str) -> String {
        let e = self.find(css);
        let v = self.call("GET", &self.s(&format!("/element/{e}/text")), None);
        v["value"].as_str().unwrap_or_default().to_string()
    }

    /// Resizes the window (a taller one shows a whole page in a screenshot).
    pub fn resize(&self, width: u32, height: u32) {
        self.call(
            "POST",
            &self.s("/window/rect"),
            Some(json!({"width": width, "height": height})),
        );
    }

    /// Waits (up to 10 s) until the page's URL contains `part`: a form's navigation is done.
    pub fn wait_for_url(&self, part: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.url().contains(part) {
            assert!(
                Instant::now() < deadline,
                "the page never reached {part:?}: {}",
                self.url()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn url(&self) -> String {
        let v = self.call("GET", &self.s("/url"), None);
        v["value"].as_str().unwrap_or_default().to_string()
    }

    /// Saves a PNG screenshot of the window.
    pub fn screenshot(&self, path: &std::path::Path) {
        let v = self.call("GET", &self.s("/screenshot"), None);
        let png = base64_decode(v["value"].as_str().expect("base64 PNG"));
        assert!(png.starts_with(b"\x89PNG"), "a PNG");
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("screenshot directory");
        }
        std::fs::write(path, png).expect("write the screenshot");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let url = format!("{}/session/{}", self.base, self.session);
            let _ = self.agent.delete(&url).call();
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0);
    for c in s.bytes().filter_map(val) {
        acc = (acc << 6) | c;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    out
}
