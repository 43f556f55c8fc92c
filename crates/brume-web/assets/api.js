// The service's native API (v1): JSON over fetch, job events over one WebSocket that
// reconnects by itself. Every failure becomes an ApiError whose message is words a person
// can act on; nothing here fails silently.

/** An error from the service or the network, in words. */
export class ApiError extends Error {
  constructor(message, { field = null, status = 0, retryAfter = null } = {}) {
    super(message);
    this.field = field;
    this.status = status;
    this.retryAfter = retryAfter;
  }
  /** "steps: must be at most 150" style text for the page. */
  describe() {
    return this.field ? `${this.field}: ${this.message}` : this.message;
  }
}

// A token given once as ?token=T in the page's address is kept for the tab, so a server
// started with a token works from a link; without one no header is sent.
const token = (() => {
  const fromUrl = new URLSearchParams(location.search).get('token');
  if (fromUrl) sessionStorage.setItem('brume.token', fromUrl);
  return fromUrl || sessionStorage.getItem('brume.token');
})();

function headers(extra = {}) {
  return token ? { ...extra, Authorization: `Bearer ${token}` } : extra;
}

/** Calls the API; resolves to the parsed JSON (null for an empty body), rejects with ApiError. */
export async function request(method, path, body) {
  let res;
  try {
    res = await fetch(path, {
      method,
      headers: headers(body === undefined ? {} : { 'Content-Type': 'application/json' }),
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch {
    throw new ApiError('Cannot reach the brume server (is `brume serve` still running?)');
  }
  const text = await res.text();
  let data = null;
  if (text) {
    try { data = JSON.parse(text); } catch { data = null; }
  }
  if (!res.ok) {
    const err = data && data.error;
    const message = err && err.message ? err.message : `the server answered ${res.status} ${res.statusText}`;
    throw new ApiError(message, {
      field: err ? err.field ?? null : null,
      status: res.status,
      retryAfter: res.headers.get('Retry-After'),
    });
  }
  return data;
}

export const api = {
  models: () => request('GET', '/api/v1/models'),
  samplers: () => request('GET', '/api/v1/samplers'),
  capabilities: () => request('GET', '/api/v1/capabilities'),
  submit: (job) => request('POST', '/api/v1/jobs', job),
  job: (id) => request('GET', `/api/v1/jobs/${encodeURIComponent(id)}`),
  cancel: (id) => request('POST', `/api/v1/jobs/${encodeURIComponent(id)}/cancel`, {}),
  gallery: (params) => request('GET', `/api/v1/gallery?${new URLSearchParams(params)}`),
  galleryItem: (id) => request('GET', `/api/v1/gallery/${encodeURIComponent(id)}`),
  patchGallery: (id, body) => request('PATCH', `/api/v1/gallery/${encodeURIComponent(id)}`, body),
  deleteGallery: (id) => request('DELETE', `/api/v1/gallery/${encodeURIComponent(id)}`),
};

/**
 * A URL an <img> can show. Without a token the API's own URL works; with one, the picture is
 * fetched with the header and shown from a blob: URL (the caller revokes it when done).
 */
export async function imageUrl(url) {
  if (!token) return url;
  const res = await fetch(url, { headers: headers() });
  if (!res.ok) throw new ApiError(`could not load ${url}: ${res.status}`);
  return URL.createObjectURL(await res.blob());
}

/** Fetches a picture as a Blob (for "edit this" and downloads). */
export async function fetchBlob(url) {
  let res;
  try {
    res = await fetch(url, { headers: headers() });
  } catch {
    throw new ApiError('Cannot reach the brume server to fetch the picture');
  }
  if (!res.ok) throw new ApiError(`could not fetch ${url}: the server answered ${res.status}`);
  return res.blob();
}

/**
 * The event socket: every event of this tab's jobs. Reconnects with a growing delay
 * (0.25 s doubling to 4 s) and tells `onState` ("open" | "reconnecting" | "connecting")
 * so the page can say so; `onOpen` lets the job tracker catch up on what it missed.
 */
export class EventSocket {
  constructor(clientId, { onEvent, onState, onOpen }) {
    this.clientId = clientId;
    this.onEvent = onEvent;
    this.onState = onState;
    this.onOpen = onOpen;
    this.delay = 250;
    this.ws = null;
    this.closed = false;
    this.replies = []; // resolvers of submits sent, answered in order by accepted / rejected
    this.connect();
  }

  get open() {
    return this.ws !== null && this.ws.readyState === WebSocket.OPEN;
  }

  connect() {
    const proto = location.protocol === 'https:' ? 'wss:' : 'ws:';
    const params = new URLSearchParams({ client: this.clientId });
    if (token) params.set('token', token);
    const ws = new WebSocket(`${proto}//${location.host}/api/v1/ws?${params}`);
    this.ws = ws;
    this.onState('connecting');
    ws.onopen = () => {
      this.delay = 250;
      this.onState('open');
      this.onOpen();
    };
    ws.onmessage = (msg) => {
      let event;
      try { event = JSON.parse(msg.data); } catch { return; }
      if ((event.type === 'accepted' || event.type === 'rejected') && this.replies.length) {
        this.replies.shift()(event);
        return;
      }
      this.onEvent(event);
    };
    // onerror is always followed by onclose; the close handler does the reconnecting.
    ws.onerror = () => {};
    ws.onclose = () => {
      if (this.ws !== ws || this.closed) return;
      this.ws = null;
      for (const reply of this.replies.splice(0)) reply({ type: 'lost' });
      this.onState('reconnecting', this.delay);
      setTimeout(() => this.connect(), this.delay);
      this.delay = Math.min(this.delay * 2, 4000);
    };
  }

  /**
   * Submits a job over the socket: the same body as POST /api/v1/jobs, answered by
   * {"type":"accepted","id","position"}. A refusal rejects with the service's words (and, unlike
   * an HTTP 4xx, leaves no network error in the browser's console).
   */
  submit(job) {
    return new Promise((resolve, reject) => {
      if (!this.send({ type: 'submit', job })) {
        reject(new ApiError('the connection to the brume server is down'));
        return;
      }
      // A socket that never answers must not hang the editor: give up after 15 s.
      const timer = setTimeout(() => {
        const i = this.replies.indexOf(answer);
        if (i >= 0) this.replies.splice(i, 1, () => {});
        reject(new ApiError('the brume server did not answer the job in 15 s'));
      }, 15000);
      const answer = (reply) => {
        clearTimeout(timer);
        if (reply.type === 'accepted') resolve({ id: reply.id, state: 'queued', position: reply.position });
        else if (reply.type === 'rejected') reject(new ApiError(reply.error?.message || 'the server refused the job', { field: reply.error?.field ?? null }));
        else reject(new ApiError('lost the connection to the brume server while submitting; try again'));
      };
      this.replies.push(answer);
    });
  }

  send(message) {
    if (!this.open) return false;
    this.ws.send(JSON.stringify(message));
    return true;
  }
}
