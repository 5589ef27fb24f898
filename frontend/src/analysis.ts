// Analysis jobs: live state and progress of job rows (WebSocket ws/workloads/<id>/analyses/, polling the API as a
// fallback on a job page), and "Open in Perfetto" (fetch the trace, open ui.perfetto.dev, PING until PONG, then
// post {perfetto: {buffer, title}}: Perfetto's documented postMessage handshake).

const STATE_LABELS: Record<string, string> = { queued: "Queued", running: "Running", done: "Done", failed: "Failed" };

interface JobMessage {
  type: "job";
  id: number;
  state: string;
  progress: number;
  error?: string;
  partitions?: number; // a partitioned run: its map tasks, and how many have finished
  partitions_done?: number;
}

function isJobMessage(value: unknown): value is JobMessage {
  return (
    typeof value === "object" &&
    value !== null &&
    (value as JobMessage).type === "job" &&
    typeof (value as JobMessage).id === "number" &&
    typeof (value as JobMessage).state === "string"
  );
}

export function applyJob(root: ParentNode, job: JobMessage): void {
  root.querySelectorAll<HTMLElement>(`[data-job-id="${job.id}"]`).forEach((row) => {
    const badge = row.querySelector<HTMLElement>("[data-job-state]");
    if (badge && job.state in STATE_LABELS) {
      badge.className = `badge badge-job-${job.state}`;
      badge.textContent = STATE_LABELS[job.state];
    }
    const bar = row.querySelector<HTMLProgressElement>("[data-job-progress]");
    if (bar) {
      bar.value = job.progress;
      bar.textContent = `${job.progress}%`;
      if (job.partitions) bar.title = `${job.partitions_done ?? 0} of ${job.partitions} partitions analysed`;
    }
  });
}

function finished(state: string): boolean {
  return state === "done" || state === "failed";
}

function watch(container: HTMLElement): void {
  const path = container.dataset.analysisSocket;
  const jobPage = container.dataset.jobPage ? Number(container.dataset.jobPage) : null;
  const onJob = (job: JobMessage): void => {
    applyJob(document, job);
    // A job page shows its result server-rendered: reload once its job finishes.
    if (jobPage === job.id && finished(job.state) && container.dataset.jobStateInitial !== job.state) {
      window.location.reload();
    }
  };
  const initial = container.querySelector<HTMLElement>("[data-job-state]");
  if (jobPage !== null && initial) {
    container.dataset.jobStateInitial = initial.textContent?.trim().toLowerCase() ?? "";
    if (finished(container.dataset.jobStateInitial)) return;
  }
  let open = false;
  if (path && typeof WebSocket !== "undefined") {
    const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
    const socket = new WebSocket(`${scheme}//${window.location.host}${path}`);
    socket.addEventListener("open", () => (open = true));
    socket.addEventListener("close", () => (open = false));
    socket.addEventListener("message", (event: MessageEvent<string>) => {
      try {
        const message: unknown = JSON.parse(event.data);
        if (isJobMessage(message)) onJob(message);
      } catch {
        // Not JSON: ignore.
      }
    });
  }
  const poll = container.dataset.jobPoll;
  if (!poll) return;
  window.setInterval(async () => {
    if (open || document.visibilityState !== "visible") return;
    try {
      const response = await fetch(poll, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (!response.ok) return;
      const body: unknown = await response.json();
      if (body && typeof body === "object") onJob({ ...(body as JobMessage), type: "job" });
    } catch {
      // Offline or restarting: try again next time.
    }
  }, 3000);
}

const PERFETTO = "https://ui.perfetto.dev";

export async function openInPerfetto(
  url: string,
  title: string,
  status: HTMLElement | null,
  timeoutMs = 20_000,
): Promise<void> {
  const say = (text: string): void => {
    if (status) status.textContent = text;
  };
  // Open the tab first, inside the click, so popup blockers allow it; the trace loads meanwhile.
  const target = window.open(PERFETTO);
  if (!target) {
    say("The browser blocked the new tab; allow pop-ups for this site, or download the trace instead.");
    return;
  }
  say("Loading the trace…");
  const response = await fetch(url, { credentials: "same-origin" });
  if (!response.ok) {
    say(`Could not load the trace (HTTP ${response.status}).`);
    return;
  }
  const buffer = await response.arrayBuffer();
  say("Waiting for Perfetto to be ready…");
  // Offline clusters cannot reach ui.perfetto.dev: give up after a while instead of waiting forever.
  const ready = await new Promise<boolean>((resolve) => {
    const started = Date.now();
    const finish = (answered: boolean): void => {
      window.clearInterval(timer);
      window.removeEventListener("message", onMessage);
      resolve(answered);
    };
    const onMessage = (event: MessageEvent): void => {
      if (event.origin === PERFETTO && event.data === "PONG") finish(true);
    };
    window.addEventListener("message", onMessage);
    const timer = window.setInterval(() => {
      if (target.closed || Date.now() - started > timeoutMs) {
        finish(false);
        return;
      }
      target.postMessage("PING", PERFETTO);
    }, 250);
  });
  if (!ready) {
    say(
      `Perfetto did not answer within ${Math.round(timeoutMs / 1000)} s: ui.perfetto.dev may be unreachable from ` +
        "here (an offline cluster?). Download the trace and open it in a Perfetto UI you can reach.",
    );
    return;
  }
  target.postMessage({ perfetto: { buffer, title, fileName: `${title}.json` } }, PERFETTO, [buffer]);
  say("Trace handed to Perfetto.");
}

export function enhanceAnalysis(root: ParentNode): void {
  root.querySelectorAll<HTMLElement>("[data-analysis-socket]").forEach(watch);
  root.querySelectorAll<HTMLButtonElement>("[data-perfetto-open]").forEach((button) => {
    button.hidden = false;
    const status = document.querySelector<HTMLElement>("[data-perfetto-status]");
    button.addEventListener("click", () => {
      void openInPerfetto(button.dataset.perfettoOpen ?? "", button.dataset.perfettoTitle ?? "trace", status);
    });
  });
}
