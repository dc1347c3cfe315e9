// Sluice web console: the routing pages (traffic classes and
// classification rules, deployment health and admission queues, requests
// and TTFT by class, "explain this decision"). Loaded before app.js, whose
// helpers (rpc, listAll, el, table, action, ...) these pages call when
// they run; app.js lists them in PAGES.
'use strict';

const TRAFFIC_CLASSES = ['TRAFFIC_CLASS_INTERACTIVE', 'TRAFFIC_CLASS_AGENT', 'TRAFFIC_CLASS_BATCH'];
const className = c => (c || '').replace('TRAFFIC_CLASS_', '').toLowerCase();
function classSelect(name, value, unsetLabel) {
  const opts = TRAFFIC_CLASSES.map(c => el('option', { value: c, selected: c === value }, className(c)));
  if (unsetLabel) opts.unshift(el('option', { value: '', selected: !value || value === 'TRAFFIC_CLASS_UNSPECIFIED' }, unsetLabel));
  return el('select', { name: name }, opts);
}
const num = v => Number(v || 0);
// scopeFilter is the tenant filter of list calls for this token.
function scopeFilter() { return isPlatform() ? {} : isTeam() ? { orgId: myOrg(), teamId: who().teamId } : { orgId: myOrg() }; }

// ---- Traffic classes ----

async function pageTraffic() {
  const orgBox = el('div', {}), credBox = el('div', {}), depBox = el('div', {});
  setMain(el('h1', {}, 'Traffic classes'),
    el('p', { class: 'muted' }, 'A request takes the class its key names, else its team\'s, else the first classification rule of its org that ' +
      'matches one of its headers, else the org\'s default; an interactive request that does not look like a person\'s is demoted to agent.'),
    orgBox, credBox, depBox);
  const jobs = [credentialClasses(credBox), admissionSettings(depBox)];
  if (!isTeam()) {
    // Team tokens cannot read their org's settings (the API refuses).
    const orgs = await orgChoices();
    const pick = orgSelect(orgs);
    pick.dataset.test = 'traffic-org';
    const inner = el('div', {});
    pick.addEventListener('change', () => orgTraffic(inner, pick.value));
    orgBox.replaceChildren(...[el('h2', {}, 'Org default, demotion and classification rules'), isPlatform() ? el('div', { class: 'toolbar' }, 'org ', pick) : null, inner].filter(Boolean));
    jobs.push(orgTraffic(inner, orgs.length ? orgs[0].id : myOrg()));
  }
  await Promise.all(jobs);
}

async function orgTraffic(box, orgId) {
  const t = (await rpc('TrafficService', 'GetOrgTraffic', { orgId: orgId })).traffic || {};
  const rules = t.rules || [];
  const dem = t.demotion || {};
  const demText = [num(dem.maxPromptTokens) ? 'prompt over ' + num(dem.maxPromptTokens) + ' tokens' : '',
    num(dem.maxInteractiveInFlightPerKey) ? num(dem.maxInteractiveInFlightPerKey) + ' interactive requests in flight per key' : ''].filter(Boolean).join(' or ');
  const kids = [
    el('p', { 'data-test': 'org-default' }, 'Default class: ', el('strong', {}, className(t.defaultClass) || 'interactive'),
      ' · demotion to agent: ', demText || 'off'),
    table([['rule', r => 'rule:' + r.i, 'num'], ['header', r => r.header], ['pattern', r => el('code', {}, r.pattern)], ['class', r => className(r.trafficClass)]],
      rules.map((r, i) => Object.assign({ id: 'rule-' + i, i: i }, r)), { test: 'rules' })];
  if (canWrite()) kids.push(orgTrafficEditor(box, orgId, t));
  box.replaceChildren(...kids);
}

// orgTrafficEditor edits the whole OrgTraffic object: SetOrgTraffic
// replaces it (validated, audited and published by the API).
function orgTrafficEditor(box, orgId, t) {
  const dem = t.demotion || {};
  const rows = el('tbody', {});
  function ruleRow(r) {
    const tr = el('tr', { class: 'rule' },
      el('td', {}, el('input', { name: 'header', value: r.header || '', placeholder: 'User-Agent', size: 14, autocomplete: 'off' })),
      el('td', {}, el('input', { name: 'pattern', value: r.pattern || '', placeholder: '^claude-cli/', size: 24, autocomplete: 'off', spellcheck: 'false' })),
      el('td', {}, classSelect('trafficClass', r.trafficClass || 'TRAFFIC_CLASS_AGENT')),
      el('td', {},
        el('button', { type: 'button', title: 'earlier', onclick: () => { if (tr.previousSibling) rows.insertBefore(tr, tr.previousSibling); } }, '↑'),
        el('button', { type: 'button', title: 'later', onclick: () => { if (tr.nextSibling) rows.insertBefore(tr.nextSibling, tr); } }, '↓'),
        el('button', { type: 'button', onclick: () => tr.remove() }, 'Remove')));
    return tr;
  }
  for (const r of t.rules || []) rows.append(ruleRow(r));
  const msg = el('span', { class: 'error', 'data-test': 'traffic-error' });
  const f = el('form', { class: 'stack', 'data-test': 'org-traffic' },
    el('strong', {}, 'Edit'),
    el('div', { class: 'inline-fields' },
      field('default class', classSelect('defaultClass', t.defaultClass, 'interactive (unset)')),
      field('demote above prompt tokens', el('input', { name: 'maxPromptTokens', type: 'number', min: 0, value: num(dem.maxPromptTokens) || '', placeholder: 'off' })),
      field('demote above interactive in flight per key', el('input', { name: 'maxInteractiveInFlightPerKey', type: 'number', min: 0, value: num(dem.maxInteractiveInFlightPerKey) || '', placeholder: 'off' }))),
    el('table', { 'data-test': 'rule-editor' }, el('thead', {}, el('tr', {}, ['header', 'pattern (RE2)', 'class', ''].map(h => el('th', {}, h)))), rows),
    el('div', { class: 'toolbar' },
      el('button', { type: 'button', 'data-test': 'add-rule', onclick: () => rows.append(ruleRow({})) }, 'Add rule'),
      el('button', { type: 'submit', 'data-test': 'save-traffic' }, 'Save'), msg));
  f.addEventListener('submit', async ev => {
    ev.preventDefault();
    msg.textContent = '';
    const v = k => f.elements[k].value.trim();
    const traffic = {
      defaultClass: v('defaultClass') || undefined,
      rules: [...rows.querySelectorAll('tr.rule')].map(tr => ({
        header: tr.querySelector('[name="header"]').value.trim(), pattern: tr.querySelector('[name="pattern"]').value,
        trafficClass: tr.querySelector('[name="trafficClass"]').value })),
      demotion: { maxPromptTokens: v('maxPromptTokens') || '0', maxInteractiveInFlightPerKey: v('maxInteractiveInFlightPerKey') || '0' },
    };
    try { await rpc('TrafficService', 'SetOrgTraffic', { orgId: orgId, traffic: traffic }); } catch (e) { msg.textContent = e.message; return; }
    await orgTraffic(box, orgId);
    box.prepend(el('p', { class: 'ok', 'data-test': 'traffic-saved' }, 'Saved: the data planes apply it with the next config event.'));
  });
  return f;
}

// credentialClasses lists the teams and keys that name a class (which
// wins over rules and the default); writers change it here.
async function credentialClasses(box) {
  const filter = scopeFilter();
  const [teams, keys] = await Promise.all([teamsOf(isPlatform() ? '' : myOrg()), listAll('KeyService', 'ListKeys', filter, 'keys')]);
  const rows = teams.map(t => ({ id: 'team-' + t.id, kind: 'team', obj: t, name: t.name }))
    .concat(keys.map(k => ({ id: 'key-' + k.id, kind: 'key', obj: k, name: k.alias || k.id })));
  const canSet = r => canWrite() && (r.kind === 'key' || !isTeam());
  const cols = [['credential', r => r.kind + ' ' + r.name], ['id', r => ref(r.obj.id)], ['class', r => className(r.obj.trafficClass) || el('span', { class: 'muted' }, 'from rules / default')]];
  if (canWrite()) cols.push(['', r => canSet(r) ? classChanger(r) : '']);
  box.replaceChildren(el('h2', {}, 'Classes named by teams and keys'), table(cols, rows, { test: 'credential-classes' }));
}

function classChanger(r) {
  const sel = classSelect('trafficClass', r.obj.trafficClass, '(none)');
  return el('span', {}, sel, action('Set', async () => {
    const body = r.kind === 'team'
      ? ['TeamService', 'UpdateTeam', { team: { id: r.obj.id, trafficClass: sel.value || 'TRAFFIC_CLASS_UNSPECIFIED' }, updateMask: 'trafficClass' }]
      : ['KeyService', 'UpdateKey', { key: { id: r.obj.id, trafficClass: sel.value || 'TRAFFIC_CLASS_UNSPECIFIED' }, updateMask: 'trafficClass' }];
    await rpc(...body);
    route();
  }, { 'data-test': 'set-class' }));
}

// admissionSettings shows the class-aware admission settings of every
// model group and deployment (SPEC §7.2); platform writers edit them.
async function admissionSettings(box) {
  const [groups, deps] = await Promise.all([listAll('ModelService', 'ListModelGroups', {}, 'modelGroups'), listAll('ModelService', 'ListDeployments', {}, 'deployments')]);
  const [gt, dt] = await Promise.all([
    Promise.all(groups.map(g => rpc('TrafficService', 'GetModelGroupTraffic', { modelGroup: g.name }).then(r => r.traffic || {}))),
    Promise.all(deps.map(d => rpc('TrafficService', 'GetDeploymentTraffic', { deploymentId: d.id }).then(r => r.traffic || {})))]);
  const queues = q => (q || []).map(x => className(x.trafficClass) + ': ' + [num(x.maxLength) ? 'max ' + num(x.maxLength) : '', num(x.timeoutMs) ? 'timeout ' + num(x.timeoutMs) + ' ms' : '']
    .filter(Boolean).join(', ')).join(' · ') || el('span', { class: 'muted' }, 'proxy defaults');
  const prio = t => { if (!t.priorityScheduling) return 'off'; const p = t.classPriority || {};
    return 'on (interactive ' + (p.interactive ?? 0) + ', agent ' + (p.agent ?? 10) + ', batch ' + (p.batch ?? 20) + ')'; };
  const editor = el('div', { id: 'admission-editor' });
  const write = isPlatform() && canWrite();
  const depCols = [['deployment', r => r.d.id], ['group', r => r.d.modelGroup], ['max concurrency', r => r.d.maxConcurrency || '∞', 'num'],
    ['interactive reserve', r => num(r.t.interactiveReserve) || '', 'num'], ['batch max concurrency', r => num(r.t.batchMaxConcurrency) || '', 'num'],
    ['max prefill tokens in flight', r => num(r.t.maxPrefillTokensInFlight) || '', 'num'], ['priority scheduling', r => prio(r.t)], ['queues', r => queues(r.t.queues)]];
  if (write) depCols.push(['', r => action('Edit', async () => deploymentTrafficEditor(editor, r.d, r.t), { 'data-test': 'edit-admission' })]);
  box.replaceChildren(el('h2', {}, 'Admission per model group'),
    table([['model group', r => r.g.name], ['queues', r => queues(r.t.queues)]], groups.map((g, i) => ({ id: g.name, g: g, t: gt[i] })), { test: 'group-admission' }),
    el('h2', {}, 'Admission per deployment'),
    table(depCols, deps.map((d, i) => ({ id: d.id, d: d, t: dt[i] })), { test: 'deployment-admission' }), editor);
}

function deploymentTrafficEditor(box, d, t) {
  const q = {};
  for (const x of t.queues || []) q[x.trafficClass] = x;
  const p = t.classPriority || {};
  const n = (name, v, ph) => el('input', { name: name, type: 'number', min: 0, value: num(v) || '', placeholder: ph || '0', size: 8 });
  const f = el('form', { class: 'inline', 'data-test': 'admission-form' }, el('strong', {}, 'Admission of ' + d.id),
    field('interactive reserve', n('interactiveReserve', t.interactiveReserve)), field('batch max concurrency', n('batchMaxConcurrency', t.batchMaxConcurrency)),
    field('max prefill tokens in flight', n('maxPrefillTokensInFlight', t.maxPrefillTokensInFlight)),
    field('priority scheduling', el('input', { type: 'checkbox', name: 'priorityScheduling', checked: !!t.priorityScheduling })),
    TRAFFIC_CLASSES.flatMap(c => [field(className(c) + ' priority', el('input', { name: 'prio_' + c, type: 'number', value: p[className(c)] ?? '', placeholder: 'default', size: 6 })),
      field(className(c) + ' queue max', n('qlen_' + c, (q[c] || {}).maxLength, 'default')), field(className(c) + ' queue timeout ms', n('qto_' + c, (q[c] || {}).timeoutMs, 'default'))]));
  const msg = el('span', { class: 'error' });
  f.append(el('button', { type: 'submit' }, 'Save'), msg);
  f.addEventListener('submit', async ev => {
    ev.preventDefault();
    const v = k => f.elements[k].value.trim();
    const out = { interactiveReserve: v('interactiveReserve') || '0', batchMaxConcurrency: v('batchMaxConcurrency') || '0',
      maxPrefillTokensInFlight: v('maxPrefillTokensInFlight') || '0', priorityScheduling: f.elements.priorityScheduling.checked, queues: [] };
    if (out.priorityScheduling) {
      out.classPriority = {};
      for (const c of TRAFFIC_CLASSES) if (v('prio_' + c) !== '') out.classPriority[className(c)] = Number(v('prio_' + c));
    }
    for (const c of TRAFFIC_CLASSES) if (v('qlen_' + c) || v('qto_' + c)) out.queues.push({ trafficClass: c, maxLength: v('qlen_' + c) || '0', timeoutMs: v('qto_' + c) || '0' });
    try { await rpc('TrafficService', 'SetDeploymentTraffic', { deploymentId: d.id, traffic: out }); } catch (e) { msg.textContent = e.message; return; }
    route();
  });
  box.replaceChildren(f);
}

// ---- Health & queues (platform: the fleet is shared) ----

async function pageHealth() {
  const [planes, deps] = await Promise.all([rpc('FleetService', 'ListDataPlanes', {}), listAll('ModelService', 'ListDeployments', {}, 'deployments')]);
  const all = planes.dataPlanes || [];
  const live = all.filter(d => d.health !== 'lost');
  const out = [];
  for (const p of live) for (const e of p.ejectedDeployments || []) out.push(Object.assign({ instanceId: p.instanceId, region: p.region }, e));
  const outOf = {};
  for (const e of out) (outOf[e.deploymentId] = outOf[e.deploymentId] || []).push(e);
  const now = Date.now();
  const until = e => e.until ? fmtTime(e.until) + ' (in ' + Math.max(0, Math.round((Date.parse(e.until) - now) / 1000)) + ' s)' : 'when a health check passes';
  const reasons = { ejected: 'ejected: consecutive failures', parked: 'parked: engine Retry-After', health_check: 'health check failing' };
  const health = d => {
    const o = outOf[d.id] || [];
    if (!live.length) return el('span', { class: 'muted' }, 'no live data plane');
    if (!o.length) return el('span', { class: 'ok' }, 'in rotation on ' + live.length + ' of ' + live.length);
    return el('span', { class: 'blocked' }, 'out on ' + o.length + ' of ' + live.length + ' (' + [...new Set(o.map(e => e.reason))].join(', ') + ')');
  };
  const backlogRows = live.map(p => {
    const b = {};
    for (const c of p.admissionBacklog || []) b[c.trafficClass] = c;
    return { id: p.instanceId, p: p, b: b };
  });
  const cell = (r, c, f) => r.b[c] ? num(r.b[c][f]) : '';
  const backlogCols = [['instance', r => r.p.instanceId], ['region', r => r.p.region], ['health', r => r.p.health]];
  for (const c of ['interactive', 'agent', 'batch']) {
    backlogCols.push([c + ' in flight', r => cell(r, c, 'inFlight'), 'num'], [c + ' queued', r => cell(r, c, 'queued'), 'num'], [c + ' shed', r => cell(r, c, 'shed'), 'num']);
  }
  setMain(el('h1', {}, 'Health & queues'),
    el('p', { class: 'muted' }, 'As of each live data plane\'s last heartbeat (every few seconds). ' + live.length + ' live of ' + all.length + ' known instances.'),
    el('div', { class: 'toolbar' }, action('Refresh', () => route(), { 'data-test': 'refresh' })),
    el('h2', {}, 'Deployments'),
    table([['deployment', d => d.id], ['group', d => d.modelGroup], ['api base', d => d.apiBase], ['health', health]], deps, { test: 'deployment-health' }),
    el('h2', {}, 'Out of rotation'),
    table([['deployment', e => e.deploymentId], ['group', e => e.modelGroup], ['instance', e => e.instanceId], ['region', e => e.region],
      ['state', e => reasons[e.reason] || e.reason], ['returns', until]], out.map(e => Object.assign({ id: e.deploymentId + '@' + e.instanceId }, e)), { test: 'ejected' }),
    el('h2', {}, 'Admission backlog per class'),
    el('p', { class: 'muted' }, 'In flight: requests of the class at deployments; queued: waiting for a slot now; shed: refused by the queue (full or timed out) since the instance started.'),
    table(backlogCols, backlogRows, { test: 'backlog' }));
}

// ---- Requests & TTFT (from the spend ledger) ----

function hourKey(t) { return new Date(t).toISOString().slice(0, 13); }
function lastHours(n) { const out = []; const now = Date.now(); for (let i = n - 1; i >= 0; i--) out.push(hourKey(now - i * 3600000)); return out; }
function quantile(sorted, q) { if (!sorted.length) return 0; return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))]; }

// lines draws one polyline per series over the buckets (a dot where a
// bucket has a value; no value, no dot: gaps are not drawn as zero).
function lines(title, buckets, series, fmt, test, label) {
  const names = Object.keys(series);
  const W = 720, H = 220, L = 60, B = 30, T = 10;
  const max = Math.max(1e-9, ...names.flatMap(n => Object.values(series[n])));
  const bw = (W - L - 10) / buckets.length;
  const x = i => L + i * bw + bw / 2, y = v => T + (H - T - B) * (1 - v / max);
  const g = svg('svg', { width: W, height: H, viewBox: '0 0 ' + W + ' ' + H, class: 'plot', 'data-test': test, role: 'img', 'aria-label': title });
  for (let i = 0; i <= 4; i++) {
    const yy = T + (H - T - B) * (1 - i / 4);
    g.append(svg('line', { x1: L, x2: W - 10, y1: yy, y2: yy, stroke: '#e3e6ec' }), svg('text', { x: L - 4, y: yy + 4, 'text-anchor': 'end' }, fmt(max * i / 4)));
  }
  buckets.forEach((b, i) => { if (i % 2 === 0) g.append(svg('text', { x: x(i), y: H - B + 14, 'text-anchor': 'middle' }, label(b))); });
  names.forEach((n, j) => {
    const c = COLORS[j % COLORS.length];
    const pts = buckets.map((b, i) => series[n][b] === undefined ? null : [x(i), y(series[n][b]), b]).filter(Boolean);
    if (pts.length > 1) g.append(svg('polyline', { points: pts.map(p => p[0] + ',' + p[1]).join(' '), fill: 'none', stroke: c, 'stroke-width': 2 }));
    for (const p of pts) g.append(svg('circle', { cx: p[0], cy: p[1], r: 3, fill: c, 'data-series': n }, svg('title', {}, p[2] + ':00 ' + n + ': ' + fmt(series[n][p[2]]))));
  });
  const legend = el('div', { class: 'legend' }, names.map((n, j) => { const s = el('span', {}, n); s.style.setProperty('--c', COLORS[j % COLORS.length]); return s; }));
  return el('div', {}, el('h2', {}, title), legend, g);
}

async function pageRequests() {
  const hours = lastHours(24);
  const start = new Date(Date.parse(hours[0] + ':00:00Z')).toISOString();
  const logs = await listAll('SpendService', 'ListSpendLogs', Object.assign({ startTime: start }, scopeFilter()), 'logs', 20000);
  const byClass = {}, ttft = {}, ttftAll = {}, rejections = {};
  for (const l of logs) {
    const h = hourKey(l.time), c = l.trafficClass || '(unclassed)';
    const ok = (l.status || 0) >= 200 && (l.status || 0) < 300;
    add(byClass, c + (ok ? ' served' : ' rejected'), h, 1);
    if (!ok) { const k = c + '|' + (l.errorCode || String(l.status || '')); rejections[k] = (rejections[k] || 0) + 1; }
    const t = num(l.ttftMs);
    if (t > 0 && ok) {
      const k = (l.route || '') + '|' + c;
      (ttftAll[k] = ttftAll[k] || []).push(t);
      if ((l.route || '') === '/v1/chat/completions') ((ttft[c] = ttft[c] || {})[h] = ttft[c][h] || []).push(t);
    }
  }
  const series = {};
  for (const [c, perHour] of Object.entries(ttft)) {
    for (const [h, v] of Object.entries(perHour)) {
      v.sort((a, b) => a - b);
      (series[c + ' p50'] = series[c + ' p50'] || {})[h] = quantile(v, 0.5);
      (series[c + ' p95'] = series[c + ' p95'] || {})[h] = quantile(v, 0.95);
    }
  }
  const ms = v => Math.round(v) + ' ms';
  const hourLabel = h => h.slice(11) + 'h';
  const ttftRows = Object.entries(ttftAll).map(([k, v]) => { v.sort((a, b) => a - b); const [r, c] = k.split('|');
    return { id: k, route: r, cls: c, n: v.length, p50: quantile(v, 0.5), p95: quantile(v, 0.95), max: v[v.length - 1] }; })
    .sort((a, b) => a.route.localeCompare(b.route) || a.cls.localeCompare(b.cls));
  const rejRows = Object.entries(rejections).map(([k, n]) => { const [c, code] = k.split('|'); return { id: k, cls: c, code: code, n: n }; }).sort((a, b) => b.n - a.n);
  setMain(el('h1', {}, 'Requests & TTFT'),
    el('p', { class: 'muted', 'data-test': 'requests-count' }, logs.length + ' requests in the last 24 hours (from the spend ledger; UTC hours). ' +
      'TTFT is the time from arrival to the first relayed chunk of a streamed response, as each data plane recorded it.'),
    stackedBars('Requests per hour by class, served and rejected', hours, byClass, v => String(Math.round(v)), 'plot-classes', hourLabel),
    el('h2', {}, 'Rejections by class and reason'),
    table([['class', r => r.cls], ['reason (error code)', r => r.code], ['requests', r => r.n, 'num']], rejRows, { test: 'rejections' }),
    Object.keys(series).length ? lines('Chat TTFT per hour by class (p50, p95)', hours, series, ms, 'plot-ttft', hourLabel)
      : el('p', { class: 'muted', 'data-test': 'no-ttft' }, 'No streamed chat completion in the last 24 hours: no TTFT to plot.'),
    el('h2', {}, 'TTFT by route and class (last 24 hours, streamed and served)'),
    table([['route', r => r.route], ['class', r => r.cls], ['streams', r => r.n, 'num'], ['p50', r => ms(r.p50), 'num'], ['p95', r => ms(r.p95), 'num'], ['max', r => ms(r.max), 'num']],
      ttftRows, { test: 'ttft' }));
}

// ---- Explain ----

const EXPLAIN_ROUTES = ['/v1/chat/completions', '/v1/completions', '/v1/embeddings', '/v1/messages', '/v1/responses'];

async function pageExplain() {
  const keys = await listAll('KeyService', 'ListKeys', scopeFilter(), 'keys');
  const result = el('div', { 'data-test': 'explain-result' });
  const cred = el('select', { name: 'cred' }, el('option', { value: 'key' }, 'virtual key (by id)'), el('option', { value: 'token' }, 'bearer token (key or JWT)'),
    el('option', { value: 'jwt' }, 'JWT claims'));
  const credFields = {
    key: field('key', el('select', { name: 'keyId' }, keys.map(k => el('option', { value: k.id }, (k.alias || k.id) + ' (' + k.id + ')')))),
    token: field('token', el('input', { name: 'token', type: 'password', autocomplete: 'off', placeholder: 'sk-sluice-… or a JWT' })),
    jwt: el('span', { class: 'inline-fields' }, field('issuer', input('issuer')), field('audience', input('audience')), field('subject', input('subject')),
      field('claims (JSON object)', el('input', { name: 'claims', placeholder: '{"team":"platform"}', size: 28, autocomplete: 'off' }))),
  };
  const credBox = el('span', { class: 'inline-fields' });
  const showCred = () => credBox.replaceChildren(credFields[cred.value]);
  cred.addEventListener('change', showCred);
  showCred();
  const msg = el('span', { class: 'error', 'data-test': 'explain-error' });
  const f = el('form', { class: 'stack', 'data-test': 'explain-form' },
    el('div', { class: 'inline-fields' }, field('credential', cred), credBox),
    el('div', { class: 'inline-fields' },
      field('region', input('region', 'empty: the only region')),
      field('route', el('select', { name: 'route' }, EXPLAIN_ROUTES.map(r => el('option', { value: r }, r)))),
      field('model', input('model', 'model group or alias')),
      field('stream', el('input', { type: 'checkbox', name: 'stream' })), field('tools', el('input', { type: 'checkbox', name: 'tools' })),
      field('max_tokens', el('input', { name: 'maxTokens', type: 'number', min: 0, size: 7 })), field('n', el('input', { name: 'n', type: 'number', min: 0, size: 4 })),
      field('prompt bytes', el('input', { name: 'promptBytes', type: 'number', min: 0, size: 8 }))),
    el('div', { class: 'inline-fields' },
      field('headers (one "Name: value" a line)', el('textarea', { name: 'headers', rows: 3, cols: 40, spellcheck: 'false', placeholder: 'User-Agent: claude-cli/1.0\nX-Session-Id: s-1' })),
      field('or a whole JSON body (replaces model and shape)', el('textarea', { name: 'body', rows: 3, cols: 50, spellcheck: 'false' }))),
    el('div', { class: 'toolbar' }, el('button', { type: 'submit', 'data-test': 'explain' }, 'Explain'), msg));
  f.addEventListener('submit', async ev => {
    ev.preventDefault();
    msg.textContent = '';
    let q;
    try { q = explainQuery(f, cred.value); } catch (e) { msg.textContent = e.message; return; }
    result.replaceChildren(el('p', { class: 'muted' }, 'asking a data plane…'));
    try {
      const r = await rpc('ExplainService', 'Explain', { region: f.elements.region.value.trim(), query: q });
      result.replaceChildren(...traceView(r.trace || {}).filter(Boolean));
    } catch (e) { result.replaceChildren(); msg.textContent = e.message; }
  });
  setMain(el('h1', {}, 'Explain this decision'),
    el('p', { class: 'muted' }, 'A live data plane of the region runs the request path on a synthetic request in dry run and says what it would do: ' +
      'nothing is admitted, counted, forwarded or billed. Only credentials of this token\'s scope can be explained.'),
    f, result);
}

function explainQuery(f, cred) {
  const v = k => f.elements[k] ? f.elements[k].value.trim() : '';
  const q = { route: v('route') };
  if (cred === 'key') q.keyId = v('keyId');
  else if (cred === 'token') q.token = v('token');
  else {
    q.jwt = { issuer: v('issuer'), audience: v('audience'), subject: v('subject') };
    if (v('claims')) {
      let c;
      try { c = JSON.parse(v('claims')); } catch (e) { throw new Error('claims: not JSON: ' + e.message); }
      if (!c || typeof c !== 'object' || Array.isArray(c)) throw new Error('claims: a JSON object, e.g. {"team":"platform"}');
      q.jwt.claims = c;
    }
  }
  const headers = {};
  for (const line of v('headers').split('\n')) {
    if (!line.trim()) continue;
    const i = line.indexOf(':');
    if (i <= 0) throw new Error('headers: "' + line.trim() + '" is not "Name: value"');
    headers[line.slice(0, i).trim()] = line.slice(i + 1).trim();
  }
  if (Object.keys(headers).length) q.headers = headers;
  if (v('body')) {
    // bytes travel base64 in Connect JSON.
    q.body = btoa(String.fromCharCode(...new TextEncoder().encode(v('body'))));
    return q;
  }
  if (v('model')) q.model = v('model');
  if (f.elements.stream.checked) q.stream = true;
  if (f.elements.tools.checked) q.tools = true;
  if (v('maxTokens')) q.maxTokens = v('maxTokens');
  if (v('n')) q.n = v('n');
  if (v('promptBytes')) q.promptBytes = v('promptBytes');
  return q;
}

function traceView(t) {
  const o = t.outcome || {}, a = t.auth || {}, c = t.trafficClass || {}, m = t.model || {}, r = t.routing || {};
  const status = num(o.status);
  const order = r.order || [];
  const kv = (rows, test) => table([['', x => x[0]], ['', x => x[1]]], rows.filter(x => x[1] !== undefined && x[1] !== '' && x[1] !== null), { test: test });
  const used = (u, l) => num(l) ? num(u) + ' / ' + num(l) : '';
  return [
    el('h2', {}, 'Outcome'),
    el('p', { class: status === 200 ? 'ok' : 'error', 'data-test': 'outcome' }, status === 200
      ? '200: forwarded to ' + (order[0] || '?') + (order.length > 1 ? ', then ' + order.slice(1).join(', ') + ' on a retryable failure' : '')
      : status + ' ' + (o.errorCode || o.errorType || '') + ' at stage ' + (o.stage || '?') + ': ' + (o.message || '')),
    el('p', { class: 'muted', 'data-test': 'answered-by' }, 'Answered by ' + (t.instanceId || '?') + ' in region ' + (t.region || '?') + ' running config v' + (t.snapshotVersion || '0') +
      ' (region sequence ' + (t.regionSeq || '0') + ') for ' + (t.route || '')),
    el('h2', {}, 'Authentication'),
    kv([['authenticated', a.authenticated ? 'yes' : 'no'], ['method', a.method], ['key', a.keyId], ['org', a.orgId], ['team', a.teamId], ['user', a.userId],
      ['end customer', a.customer], ['refused with', a.errorCode]], 'trace-auth'),
    el('h2', {}, 'Traffic class'),
    kv([['class', c.class], ['reason', c.reason], ['why', c.detail]], 'trace-class'),
    el('h2', {}, 'Model'),
    kv([['requested', m.requested], ['group', m.group], ['alias of', m.aliasSource ? 'a ' + m.aliasSource + ' alias' : ''], ['group exists', m.requested ? (m.groupExists ? 'yes' : 'no') : '']], 'trace-model'),
    el('h2', {}, 'Deployments'),
    table([['deployment', d => d.id], ['upstream model', d => d.upstreamModel], ['weight', d => d.weight || 0, 'num'], ['tags', d => (d.tags || []).join(',')],
      ['', d => d.candidate ? el('span', { class: 'ok' }, 'candidate' + (order.indexOf(d.id) >= 0 ? ' #' + (order.indexOf(d.id) + 1) : '')) : el('span', { class: 'blocked' }, 'filtered by ' + d.filteredBy)],
      ['why', d => d.reason]], t.deployments || [], { test: 'trace-deployments' }),
    el('h2', {}, 'Limit scopes'),
    el('p', { class: 'muted' }, 'Estimated tokens ' + num(t.estimatedTokens) + ' · maximum cost reserved ' + usd(t.maxCostUsd)),
    table([['scope', s => s.kind + ' ' + s.id], ['rpm', s => used(s.rpmUsed, s.rpmLimit), 'num'], ['tpm', s => used(s.tpmUsed, s.tpmLimit), 'num'],
      ['parallel', s => used(s.parallelInUse, s.parallelLimit), 'num'],
      ['budget', s => s.budgetCapUsd !== undefined ? usd(s.budgetSpendUsd) + ' / ' + usd(s.budgetCapUsd) + (s.budgetWindow ? ' per ' + s.budgetWindow : '') + (s.budgetState ? ' (' + s.budgetState + ')' : '') : ''],
      ['would exceed', s => s.unknown ? 'unknown (limits store unreadable)' : s.wouldExceed ? el('span', { class: 'blocked' }, s.wouldExceed) : 'fits']],
    (t.scopes || []).map(s => Object.assign({ id: s.kind + ':' + s.id }, s)), { test: 'trace-scopes' }),
    el('h2', {}, 'Routing'),
    kv([['order', order.join(' → ')], ['reason', r.reason], ['session', r.session], ['pinned to', r.pinned], ['attempts at most', r.maxAttempts]], 'trace-routing'),
    (t.notes || []).length ? el('div', {}, el('h2', {}, 'Notes'), el('ul', { 'data-test': 'trace-notes' }, t.notes.map(n => el('li', {}, n)))) : null,
  ];
}
