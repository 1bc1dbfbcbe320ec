//! A Dynamo cluster on one machine: etcd, NATS, Dynamo's frontend and N chimera workers, on
//! ports of 127.0.0.1, stopped (and their files removed) when the [`Cluster`] is dropped.
//!
//! Used by `chimera bench --dynamo-workers N` and by the Dynamo tests. Every process logs to
//! a file of its own under the cluster's folder ([`Cluster::log`] reads one back), so a
//! failure can show what each part said. Nothing here knows chimera's internals: workers are
//! a binary started with arguments, the frontend a Python module.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// What to start.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// Workers to start.
    pub workers: usize,
    /// The frontend's `--router-mode` (`kv`, `round-robin`, `random`, ...).
    pub router_mode: String,
    /// The `chimera-dynamo` binary.
    pub worker_bin: PathBuf,
    /// Arguments every worker gets (model, replicas, announce rule, ...).
    pub worker_args: Vec<String>,
    /// A Python whose `dynamo` package runs the frontend (`python -m dynamo.frontend`).
    pub python: PathBuf,
    /// KV block size the frontend's router hashes prompts with (the workers' cache block size).
    pub block_size: u32,
    /// More frontend arguments.
    pub frontend_args: Vec<String>,
    /// How long a part may take to come up.
    pub start_timeout: Duration,
}

impl ClusterSpec {
    /// `workers` workers of `worker_bin` behind a frontend routing with `router_mode`; the
    /// Python is `$CHIMERA_DYNAMO_PYTHON`, else `python3`.
    pub fn new(workers: usize, router_mode: &str, worker_bin: impl Into<PathBuf>) -> Self {
        Self {
            workers,
            router_mode: router_mode.into(),
            worker_bin: worker_bin.into(),
            worker_args: Vec::new(),
            python: std::env::var_os("CHIMERA_DYNAMO_PYTHON")
                .map_or_else(|| PathBuf::from("python3"), PathBuf::from),
            block_size: 16,
            frontend_args: Vec::new(),
            start_timeout: Duration::from_secs(120),
        }
    }
}

struct Proc {
    name: String,
    child: Child,
}

impl Proc {
    fn terminate(&self) {
        send_signal(self.child.id() as i32, Signal::Term);
    }

    /// Waits for the process to exit until `deadline`, then kills it.
    fn reap(&mut self, deadline: Instant) {
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

enum Signal {
    Term,
    Kill,
}

/// Sends a signal with the `kill` command (no libc binding needed here).
fn send_signal(pid: i32, signal: Signal) {
    let sig = match signal {
        Signal::Term => "-TERM",
        Signal::Kill => "-KILL",
    };
    let _ = Command::new("kill")
        .args([sig, &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// A running cluster. Dropping it stops every process and removes its folder.
pub struct Cluster {
    spec: ClusterSpec,
    dir: PathBuf,
    env: Vec<(String, String)>,
    /// The frontend's OpenAI API root, e.g. `http://127.0.0.1:PORT`.
    pub url: String,
    services: Vec<Proc>,
    workers: Vec<Option<Proc>>,
    /// Each worker's system port (`/health`, `/metrics`).
    pub worker_ports: Vec<u16>,
    namespace: String,
}

/// A free TCP port on 127.0.0.1 (bound, then released for the child to take), below 32768:
/// Dynamo reads `DYN_SYSTEM_PORT` as a signed 16-bit number, and the kernel's ephemeral range
/// (where port 0 binds) starts above it. Successive calls walk the range from a per-process
/// offset, so that two harnesses on one machine rarely try the same ports.
pub fn free_port() -> anyhow::Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    let base = std::process::id().wrapping_mul(2_654_435_761) % SPAN;
    for _ in 0..SPAN {
        let port = LOW + (base + NEXT.fetch_add(1, Ordering::Relaxed)) % SPAN;
        if TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
            return Ok(port as u16);
        }
    }
    bail!("no free TCP port in {LOW}..{}", LOW + SPAN)
}

/// A plain HTTP/1.0 GET on 127.0.0.1: the status and body.
pub fn http_get(port: u16, path: &str) -> anyhow::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("no HTTP status line")?;
    let body = text
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string());
    Ok((status, body))
}

fn wait_for(what: &str, timeout: Duration, mut ready: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if ready() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("{what} did not come up within {timeout:?}")
}

impl Cluster {
    /// Starts etcd, NATS, the workers and the frontend, and waits until the frontend lists the
    /// model with every worker registered. On failure, everything started is stopped and the
    /// error carries the tail of the failing part's log.
    pub fn start(spec: ClusterSpec) -> anyhow::Result<Self> {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!(
            "chimera-dynamo-cluster-{}-{stamp}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir)?;
        let namespace = format!("chimera{}", std::process::id());
        let mut c = Self {
            spec,
            dir,
            env: Vec::new(),
            url: String::new(),
            services: Vec::new(),
            workers: Vec::new(),
            worker_ports: Vec::new(),
            namespace,
        };
        c.start_services()?;
        for i in 0..c.spec.workers {
            c.start_worker(i)?;
        }
        c.start_frontend()?;
        c.wait_workers(c.spec.workers)?;
        Ok(c)
    }

    fn spawn(&self, name: &str, cmd: &mut Command) -> anyhow::Result<Proc> {
        let log = std::fs::File::create(self.dir.join(format!("{name}.log")))?;
        let child = cmd
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {name} ({:?})", cmd.get_program()))?;
        Ok(Proc {
            name: name.into(),
            child,
        })
    }

    /// The log of one part (`etcd`, `nats`, `frontend`, `worker-0`, ...).
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default()
    }

    fn tail(&self, name: &str) -> String {
        let log = self.log(name);
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    fn start_services(&mut self) -> anyhow::Result<()> {
        let (client, peer, nats) = (free_port()?, free_port()?, free_port()?);
        let etcd_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let etcd = self.spawn(
            "etcd",
            Command::new("etcd")
                .arg("--name")
                .arg("chimera")
                .arg("--data-dir")
                .arg(self.dir.join("etcd"))
                .args(["--listen-client-urls", &etcd_url])
                .args(["--advertise-client-urls", &etcd_url])
                .args(["--listen-peer-urls", &peer_url])
                .args(["--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &format!("chimera={peer_url}")]),
        )?;
        self.services.push(etcd);
        let nats_proc = self.spawn(
            "nats",
            Command::new("nats-server")
                .args(["-a", "127.0.0.1", "-p", &nats.to_string(), "-js", "-sd"])
                .arg(self.dir.join("nats")),
        )?;
        self.services.push(nats_proc);
        self.env = vec![
            ("ETCD_ENDPOINTS".into(), etcd_url),
            ("NATS_SERVER".into(), format!("nats://127.0.0.1:{nats}")),
            ("DYN_NAMESPACE".into(), self.namespace.clone()),
        ];
        let timeout = self.spec.start_timeout;
        wait_for("etcd", timeout, || {
            http_get(client, "/health").is_ok_and(|(s, b)| s == 200 && b.contains("true"))
        })
        .with_context(|| self.tail("etcd"))?;
        wait_for("nats-server", timeout, || {
            TcpStream::connect(("127.0.0.1", nats)).is_ok()
        })
        .with_context(|| self.tail("nats"))?;
        Ok(())
    }

    fn start_worker(&mut self, i: usize) -> anyhow::Result<()> {
        let port = match self.worker_ports.get(i) {
            Some(&p) => p,
            None => {
                let p = free_port()?;
                self.worker_ports.push(p);
                p
            }
        };
        let name = format!("worker-{i}");
        // One card folder for all: workers of one model must register identical cards.
        let card = self.dir.join("card");
        let proc = self.spawn(
            &name,
            Command::new(&self.spec.worker_bin)
                .args(&self.spec.worker_args)
                .arg("--card-dir")
                .arg(card)
                .env("DYN_SYSTEM_ENABLED", "true")
                .env("DYN_SYSTEM_PORT", port.to_string()),
        )?;
        if self.workers.len() <= i {
            self.workers.resize_with(i + 1, || None);
        }
        self.workers[i] = Some(proc);
        let timeout = self.spec.start_timeout;
        let mut exited = false;
        let ready = wait_for(&name, timeout, || {
            if let Some(p) = self.workers[i].as_mut()
                && !p.alive()
            {
                exited = true;
                return true;
            }
            http_get(port, "/health").is_ok_and(|(s, _)| s == 200)
        });
        if exited {
            bail!("{name} exited while starting:\n{}", self.tail(&name));
        }
        ready.with_context(|| self.tail(&name))
    }

    fn start_frontend(&mut self) -> anyhow::Result<()> {
        let port = free_port()?;
        let proc = self.spawn(
            "frontend",
            Command::new(&self.spec.python)
                .args(["-m", "dynamo.frontend", "--http-host", "127.0.0.1"])
                .args(["--http-port", &port.to_string()])
                .args(["--router-mode", &self.spec.router_mode])
                .args(["--kv-cache-block-size", &self.spec.block_size.to_string()])
                .args(["--namespace", &self.namespace])
                .args(&self.spec.frontend_args),
        )?;
        self.services.push(proc);
        self.url = format!("http://127.0.0.1:{port}");
        let timeout = self.spec.start_timeout;
        wait_for("the Dynamo frontend", timeout, || {
            http_get(port, "/v1/models").is_ok_and(|(s, b)| s == 200 && b.contains("\"id\""))
        })
        .with_context(|| self.tail("frontend"))
    }

    /// The frontend's port.
    pub fn port(&self) -> u16 {
        self.url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or(0)
    }

    /// Waits until the frontend sees `n` live instances of the workers' endpoint.
    pub fn wait_workers(&self, n: usize) -> anyhow::Result<()> {
        let port = self.port();
        wait_for(
            &format!("{n} worker(s) registered with the frontend"),
            self.spec.start_timeout,
            || self.instances(port) == Some(n),
        )
        .with_context(|| self.tail("frontend"))
    }

    /// Instances of the `generate` endpoint the frontend's `/health` lists.
    fn instances(&self, port: u16) -> Option<usize> {
        let (status, body) = http_get(port, "/health").ok()?;
        if status != 200 {
            return None;
        }
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        let list = v.get("instances")?.as_array()?;
        Some(
            list.iter()
                .filter(|i| i.get("endpoint").and_then(|e| e.as_str()) == Some("generate"))
                .count(),
        )
    }

    /// Kills worker `i` at once (SIGKILL: no drain, no unregister), as a crash would.
    pub fn kill_worker(&mut self, i: usize) {
        if let Some(mut p) = self.workers.get_mut(i).and_then(Option::take) {
            send_signal(p.child.id() as i32, Signal::Kill);
            let _ = p.child.wait();
        }
    }

    /// Starts worker `i` again (after [`Self::kill_worker`]) and waits until it serves.
    pub fn restart_worker(&mut self, i: usize) -> anyhow::Result<()> {
        // A restarted worker appends to its log.
        let name = format!("worker-{i}");
        let old = self.log(&name);
        std::fs::write(self.dir.join(format!("{name}.before-restart.log")), old)?;
        self.start_worker(i)
    }

    /// A worker's `/metrics` text.
    pub fn worker_metrics(&self, i: usize) -> anyhow::Result<String> {
        let port = *self.worker_ports.get(i).context("no such worker")?;
        let (status, body) = http_get(port, "/metrics")?;
        if status != 200 {
            bail!("worker {i} /metrics: HTTP {status}");
        }
        Ok(body)
    }

    /// Sums a counter over every live worker's `/metrics` (0 where a worker lacks it).
    pub fn worker_counter(&self, name: &str) -> f64 {
        (0..self.worker_ports.len())
            .filter_map(|i| self.worker_metrics(i).ok())
            .map(|text| counter(&text, name))
            .sum()
    }

    /// The cluster's folder (logs, etcd and NATS data).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// The value of an unlabelled series `name` in Prometheus text (0 when absent).
pub fn counter(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (n, v) = l.rsplit_once(' ')?;
            (n == name).then(|| v.parse().ok()).flatten()
        })
        .unwrap_or(0.0)
}

/// Stops processes: SIGTERM to all (Dynamo workers unregister and drain), then SIGKILL to
/// what is left after a grace.
fn stop_all(procs: &mut [Proc]) {
    for p in procs.iter() {
        p.terminate();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    for p in procs.iter_mut() {
        p.reap(deadline);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // The frontend and workers first, then the services they talk to.
        let (mut front, mut services): (Vec<Proc>, Vec<Proc>) =
            self.services.drain(..).partition(|p| p.name == "frontend");
        front.extend(self.workers.iter_mut().filter_map(Option::take));
        stop_all(&mut front);
        stop_all(&mut services);
        if std::env::var_os("CHIMERA_KEEP_CLUSTER").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_read_from_prometheus_text() {
        let text = "# HELP a x\n# TYPE a counter\na 3\nb{x=\"1\"} 4\nab 5\n";
        assert_eq!(counter(text, "a"), 3.0);
        assert_eq!(counter(text, "ab"), 5.0);
        assert_eq!(counter(text, "c"), 0.0);
    }
}
