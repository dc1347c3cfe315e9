// Sluice web console. Every read and change goes to the admin API of this
// origin (Connect JSON over fetch) with the pasted token, so the API
// authorises and audits it. The token lives in sessionStorage only.
'use strict';

const TOKEN_KEY = 'sluice.console.token';
const S = { token: sessionStorage.getItem(TOKEN_KEY) || '', who: null };

class RPCError extends Error {
  constructor(code, message) { super(code + ': ' + message); this.code = code; }
}

async function rpc(service, method, body) {
  const resp = await fetch('/sluice.admin.v1.' + service + '/' + method, {
    method: 'POST', credentials: 'omit', cache: 'no-store', referrerPolicy: 'no-referrer',
    headers: { 'Content-Type': 'application/json', 'Connect-Protocol-Version': '1', 'Authorization': 'Bearer ' + S.token },
    body: JSON.stringify(body || {}),
  });
  let j = {};
  try { j = await resp.json(); } catch (e) { j = {}; }
  if (!resp.ok) throw new RPCError(j.code || ('http_' + resp.status), j.message || resp.statusText);
  return j;
}

// listAll pages through a List RPC (at most max items).
async function listAll(service, method, body, field, max) {
  const out = [];
  let pageToken = '';
  max = max || 2000;
  do {
    const r = await rpc(service, method, Object.assign({}, body, { pageSize: 500, pageToken: pageToken }));
    out.push(...(r[field] || []));
    pageToken = r.nextPageToken || '';
  } while (pageToken && out.length < max);
  return out;
}

// ---- DOM helpers (text only: no HTML from data ever reaches innerHTML) ----
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
    else if (k === 'class') e.className = v;
    else e.setAttribute(k, v === true ? '' : v);
  }
  for (const k of kids.flat()) if (k !== null && k !== undefined && k !== false) e.append(k instanceof Node ? k : String(k));
  return e;
}
const main = () => document.getElementById('main');
function setMain(...kids) { const m = main(); m.replaceChildren(...kids); }
function errBox(e) { return el('p', { class: 'error', 'data-test': 'error' }, String(e.message || e)); }
function table(cols, rows, opts) {
  opts = opts || {};
  return el('table', { 'data-test': opts.test },
    el('thead', {}, el('tr', {}, cols.map(c => el('th', {}, c[0])))),
    el('tbody', {}, rows.length === 0 ? el('tr', {}, el('td', { colspan: cols.length, class: 'muted' }, 'none')) :
      rows.map(r => el('tr', { 'data-id': r.id || r.name || r.seq || r.instanceId || r.alertId },
        cols.map(c => { const v = c[1](r); return el('td', { class: c[2] }, v); })))));
}
// ref shows an id another row refers to, shortened (the whole id on hover).
function ref(id, name) {
  if (!id) return '';
  const short = name || (id.length > 16 ? id.slice(0, id.indexOf('_') + 1) + '…' + id.slice(-6) : id);
  return el('span', { title: id, class: 'ref' }, short);
}
function fmtTime(t) { return t ? new Date(t).toISOString().replace('T', ' ').replace(/\.\d+Z$/, 'Z') : ''; }
function usd(v) { v = Number(v || 0); return '$' + (v === 0 ? '0' : Math.abs(v) < 0.01 ? v.toPrecision(2) : v.toFixed(2)); }
function fmtLimits(l) {
  if (!l) return '';
  const parts = [];
  if (l.maxBudget !== undefined) parts.push('budget ' + usd(l.maxBudget) + (l.budgetDuration ? '/' + l.budgetDuration : ''));
  if (l.softBudget !== undefined) parts.push('soft ' + usd(l.softBudget));
  if (l.rpmLimit !== undefined) parts.push('rpm ' + l.rpmLimit);
  if (l.tpmLimit !== undefined) parts.push('tpm ' + l.tpmLimit);
  if (l.maxParallelRequests !== undefined) parts.push('parallel ' + l.maxParallelRequests);
  if (l.allowedModels && l.allowedModels.length) parts.push('models ' + l.allowedModels.join(','));
  return parts.join(' · ');
}
function state(blocked) { return blocked ? el('span', { class: 'blocked' }, 'blocked') : 'active'; }
function field(label, input) { return el('label', {}, label, input); }
function input(name, ph, type) { return el('input', { name: name, placeholder: ph || '', type: type || 'text', autocomplete: 'off' }); }
function formValues(f) { const o = {}; for (const x of f.elements) if (x.name) o[x.name] = x.value.trim(); return o; }
// limitsFrom reads the optional limit inputs of a form into a Limits message.
function limitsFrom(v) {
  const l = {};
  if (v.maxBudget) l.maxBudget = Number(v.maxBudget);
  if (v.budgetDuration) l.budgetDuration = v.budgetDuration;
  if (v.rpmLimit) l.rpmLimit = v.rpmLimit;
  if (v.tpmLimit) l.tpmLimit = v.tpmLimit;
  if (v.maxParallelRequests) l.maxParallelRequests = v.maxParallelRequests;
  return Object.keys(l).length ? l : undefined;
}
function limitInputs() {
  return [field('max budget $', input('maxBudget', '', 'number')), field('budget window', input('budgetDuration', 'e.g. 30d')),
    field('rpm', input('rpmLimit', '', 'number')), field('tpm', input('tpmLimit', '', 'number')),
    field('parallel', input('maxParallelRequests', '', 'number'))];
}
// action runs fn, shows its error next to the button, then re-renders.
function action(label, fn, attrs) {
  const b = el('button', Object.assign({ type: 'button' }, attrs || {}), label);
  b.addEventListener('click', async () => {
    b.disabled = true;
    try { await fn(); } catch (e) { b.after(errBox(e)); b.disabled = false; return; }
    b.disabled = false;
  });
  return b;
}
function submitForm(f, fn) {
  const msg = el('span', { class: 'error' });
  f.append(el('button', { type: 'submit' }, 'Create'), msg);
  f.addEventListener('submit', async ev => {
    ev.preventDefault();
    msg.textContent = '';
    try { await fn(formValues(f)); } catch (e) { msg.textContent = e.message; }
  });
  return f;
}

// ---- what this token may do ----
const who = () => S.who || {};
const isPlatform = () => who().scope === 'SCOPE_PLATFORM';
const isTeam = () => who().scope === 'SCOPE_TEAM';
const roleRank = { ROLE_VIEWER: 1, ROLE_EDITOR: 2, ROLE_ADMIN: 3 };
const canWrite = () => (roleRank[who().role] || 0) >= 2;
const myOrg = () => who().orgId || '';

// orgChoices is the orgs this token may pick from.
async function orgChoices() {
  if (!isPlatform()) return [{ id: myOrg(), name: 'this org' }];
  return listAll('OrgService', 'ListOrgs', {}, 'orgs');
}
function orgSelect(orgs, name) {
  return el('select', { name: name || 'orgId' }, orgs.map(o => el('option', { value: o.id }, o.name + ' (' + o.id + ')')));
}
async function teamsOf(orgId) {
  if (isTeam()) return [(await rpc('TeamService', 'GetTeam', { id: who().teamId })).team];
  return listAll('TeamService', 'ListTeams', orgId ? { orgId: orgId } : {}, 'teams');
}

// ---- pages ----
const PAGES = [
  ['overview', 'Overview', () => true, pageOverview],
  ['orgs', 'Orgs', () => true, pageOrgs],
  ['teams', 'Teams', () => true, pageTeams],
  ['users', 'Users', () => !isTeam(), pageUsers],
  ['keys', 'Keys', () => true, pageKeys],
  ['customers', 'End customers', () => !isTeam(), pageCustomers],
  ['models', 'Models', () => true, pageModels],
  ['traffic', 'Traffic classes', () => true, pageTraffic],
  ['health', 'Health & queues', () => isPlatform(), pageHealth],
  ['fleet', 'Fleet & rollout', () => isPlatform(), pageFleet],
  ['alerts', 'Alerts', () => true, pageAlerts],
  ['audit', 'Audit log', () => true, pageAudit],
  ['spend', 'Spend', () => true, pageSpend],
  ['requests', 'Requests & TTFT', () => true, pageRequests],
  ['explain', 'Explain', () => true, pageExplain],
];

async function pageOverview() {
  const w = who();
  const rows = [['principal', w.principal], ['name', w.name], ['scope', w.scope], ['org', w.orgId], ['team', w.teamId], ['role', w.role],
    ['expires', fmtTime(w.expireTime) || 'never']].filter(r => r[1]);
  const box = el('div', {});
  setMain(el('h1', {}, 'Overview'), table([['', r => r[0]], ['', r => r[1]]], rows, { test: 'whoami' }), box);
  await spendPlots(box, 7);
}

async function pageOrgs() {
  const orgs = isPlatform() ? await listAll('OrgService', 'ListOrgs', {}, 'orgs') : [(await rpc('OrgService', 'GetOrg', { id: myOrg() })).org];
  const cols = [['id', o => o.id], ['name', o => o.name], ['limits', o => fmtLimits(o.limits)], ['state', o => state(o.blocked)],
    ['created', o => fmtTime(o.createTime)]];
  if (isPlatform() && canWrite()) cols.push(['', o => action(o.blocked ? 'Unblock' : 'Block', async () => {
    await rpc('OrgService', o.blocked ? 'UnblockOrg' : 'BlockOrg', { id: o.id }); route();
  })]);
  const kids = [el('h1', {}, 'Orgs'), table(cols, orgs, { test: 'orgs' })];
  if (isPlatform() && canWrite()) {
    kids.push(el('h2', {}, 'New org'), submitForm(el('form', { class: 'inline', 'data-test': 'new-org' }, field('name', input('name')), limitInputs()),
      async v => { await rpc('OrgService', 'CreateOrg', { name: v.name, limits: limitsFrom(v) }); route(); }));
  }
  setMain(...kids);
}

async function pageTeams() {
  const teams = await teamsOf(isPlatform() ? '' : myOrg());
  const members = el('div', {});
  const cols = [['id', t => t.id], ['org', t => ref(t.orgId)], ['name', t => t.name], ['class', t => (t.trafficClass || '').replace('TRAFFIC_CLASS_', '').toLowerCase()],
    ['limits', t => fmtLimits(t.limits)], ['state', t => state(t.blocked)],
    ['', t => el('span', {}, action('Members', () => showMembers(members, t)),
      canWrite() && !isTeam() ? action(t.blocked ? 'Unblock' : 'Block', async () => { await rpc('TeamService', t.blocked ? 'UnblockTeam' : 'BlockTeam', { id: t.id }); route(); }) : null)]];
  const kids = [el('h1', {}, 'Teams'), table(cols, teams, { test: 'teams' }), members];
  if (canWrite() && !isTeam()) {
    const orgs = await orgChoices();
    kids.push(el('h2', {}, 'New team'), submitForm(el('form', { class: 'inline', 'data-test': 'new-team' }, field('org', orgSelect(orgs)), field('name', input('name')), limitInputs()),
      async v => { await rpc('TeamService', 'CreateTeam', { orgId: v.orgId, name: v.name, limits: limitsFrom(v) }); route(); }));
  }
  setMain(...kids);
}

async function showMembers(box, team) {
  const ms = await listAll('TeamService', 'ListTeamMembers', { teamId: team.id }, 'members');
  const cols = [['user', m => m.userId], ['budget in team', m => m.maxBudgetInTeam !== undefined ? usd(m.maxBudgetInTeam) : ''], ['limits', m => fmtLimits(m.limits)]];
  if (canWrite()) cols.push(['', m => action('Remove', async () => { await rpc('TeamService', 'RemoveTeamMember', { teamId: team.id, userId: m.userId }); showMembers(box, team); })]);
  const kids = [el('h2', {}, 'Members of ' + team.name), table(cols, ms, { test: 'members' })];
  if (canWrite()) kids.push(submitForm(el('form', { class: 'inline' }, field('user id', input('userId', 'user_…'))),
    async v => { await rpc('TeamService', 'AddTeamMember', { teamId: team.id, userId: v.userId }); showMembers(box, team); }));
  box.replaceChildren(...kids);
}

async function pageUsers() {
  const users = await listAll('UserService', 'ListUsers', isPlatform() ? {} : { orgId: myOrg() }, 'users');
  const cols = [['id', u => u.id], ['org', u => ref(u.orgId)], ['email', u => u.email], ['name', u => u.displayName], ['limits', u => fmtLimits(u.limits)],
    ['state', u => state(u.blocked)]];
  if (canWrite()) cols.push(['', u => action(u.blocked ? 'Unblock' : 'Block', async () => { await rpc('UserService', u.blocked ? 'UnblockUser' : 'BlockUser', { id: u.id }); route(); })]);
  const kids = [el('h1', {}, 'Users'), table(cols, users, { test: 'users' })];
  if (canWrite()) {
    const orgs = await orgChoices();
    kids.push(el('h2', {}, 'New user'), submitForm(el('form', { class: 'inline' }, field('org', orgSelect(orgs)), field('email', input('email')),
      field('display name', input('displayName')), limitInputs()),
    async v => { await rpc('UserService', 'CreateUser', { orgId: v.orgId, email: v.email, displayName: v.displayName, limits: limitsFrom(v) }); route(); }));
  }
  setMain(...kids);
}

// secretBox shows a token once; it is never stored by the console.
function secretBox(title, token, extra) {
  return el('div', { class: 'secret', 'data-test': 'secret' }, el('strong', {}, title),
    el('code', { 'data-test': 'token' }, token), el('span', {}, 'Copy it now: it is shown only this once. ' + (extra || '')),
    el('button', { type: 'button', onclick: ev => ev.target.parentNode.remove() }, 'Done'));
}

async function pageKeys() {
  const filter = isPlatform() ? {} : isTeam() ? { orgId: myOrg(), teamId: who().teamId } : { orgId: myOrg() };
  const keys = await listAll('KeyService', 'ListKeys', filter, 'keys');
  const teams = await teamsOf(isPlatform() ? '' : myOrg());
  const teamName = {};
  for (const t of teams) teamName[t.id] = t.name;
  const notice = el('div', {});
  const cols = [['id', k => k.id], ['alias', k => k.alias], ['key', k => (k.displayPrefix || '') + '…' + (k.last4 || '')], ['team', k => ref(k.teamId, teamName[k.teamId])],
    ['user', k => ref(k.userId)], ['limits', k => fmtLimits(k.limits)], ['state', k => state(k.blocked)],
    ['rotated', k => k.rotationCount ? k.rotationCount + '× ' + fmtTime(k.rotateTime) : '']];
  if (canWrite()) cols.push(['', k => el('span', {},
    action(k.blocked ? 'Unblock' : 'Block', async () => { await rpc('KeyService', k.blocked ? 'UnblockKey' : 'BlockKey', { id: k.id }); route(); }, { 'data-test': 'block' }),
    el('input', { class: 'grace', placeholder: 'grace e.g. 1h', size: 8, 'data-test': 'grace' }),
    action('Rotate', async ev => {
      const grace = document.querySelector('tr[data-id="' + k.id + '"] input.grace').value.trim();
      const r = await rpc('KeyService', 'RotateKey', { id: k.id, gracePeriod: grace });
      await route();
      document.getElementById('key-notice').replaceChildren(secretBox('New token of ' + (k.alias || k.id), r.token,
        r.oldTokenValidUntil ? 'The old token stays valid until ' + fmtTime(r.oldTokenValidUntil) + '.' : 'The old token stopped working now.'));
    }, { 'data-test': 'rotate' }),
    action('Limits', async () => editKeyLimits(notice, k), { 'data-test': 'limits' }))]);
  notice.id = 'key-notice';
  const kids = [el('h1', {}, 'Keys'), notice, table(cols, keys, { test: 'keys' })];
  if (canWrite()) {
    const orgs = await orgChoices();
    kids.push(el('h2', {}, 'New key'), submitForm(el('form', { class: 'inline', 'data-test': 'new-key' },
      field('org', orgSelect(orgs)), field('team', el('select', { name: 'teamId' }, el('option', { value: '' }, isTeam() ? null : '(org key)'),
        teams.map(t => el('option', { value: t.id }, t.name + ' (' + t.id + ')')))),
      field('alias', input('alias')), field('user id', input('userId', 'optional')), limitInputs()),
    async v => {
      const r = await rpc('KeyService', 'CreateKey', { orgId: v.orgId, teamId: v.teamId, userId: v.userId, alias: v.alias, limits: limitsFrom(v) });
      await route();
      document.getElementById('key-notice').replaceChildren(secretBox('New key ' + (r.key.alias || r.key.id), r.token));
    }));
  }
  setMain(...kids);
}

function editKeyLimits(box, k) {
  const l = k.limits || {};
  const f = el('form', { class: 'inline', 'data-test': 'key-limits' }, el('strong', {}, 'Limits of ' + (k.alias || k.id)), limitInputs());
  for (const [n, v] of Object.entries({ maxBudget: l.maxBudget, budgetDuration: l.budgetDuration, rpmLimit: l.rpmLimit, tpmLimit: l.tpmLimit, maxParallelRequests: l.maxParallelRequests })) {
    if (v !== undefined) f.elements[n].value = v;
  }
  const msg = el('span', { class: 'error' });
  f.append(el('button', { type: 'submit' }, 'Save'), msg);
  f.addEventListener('submit', async ev => {
    ev.preventDefault();
    try {
      const nl = Object.assign({}, l, { maxBudget: undefined, budgetDuration: undefined, rpmLimit: undefined, tpmLimit: undefined, maxParallelRequests: undefined }, limitsFrom(formValues(f)) || {});
      await rpc('KeyService', 'UpdateKey', { key: { id: k.id, limits: JSON.parse(JSON.stringify(nl)) }, updateMask: 'limits' });
      route();
    } catch (e) { msg.textContent = e.message; }
  });
  box.replaceChildren(f);
}

async function pageCustomers() {
  const cs = await listAll('CustomerService', 'ListCustomers', isPlatform() ? {} : { orgId: myOrg() }, 'customers');
  const cols = [['id', c => c.id], ['org', c => ref(c.orgId)], ['external id', c => c.externalId], ['name', c => c.displayName], ['limits', c => fmtLimits(c.limits)],
    ['state', c => state(c.blocked)]];
  if (canWrite()) cols.push(['', c => action(c.blocked ? 'Unblock' : 'Block', async () => { await rpc('CustomerService', c.blocked ? 'UnblockCustomer' : 'BlockCustomer', { id: c.id }); route(); })]);
  const kids = [el('h1', {}, 'End customers'), table(cols, cs, { test: 'customers' })];
  if (canWrite()) {
    const orgs = await orgChoices();
    kids.push(el('h2', {}, 'New end customer'), submitForm(el('form', { class: 'inline' }, field('org', orgSelect(orgs)), field('external id', input('externalId')),
      field('display name', input('displayName')), limitInputs()),
    async v => { await rpc('CustomerService', 'CreateCustomer', { orgId: v.orgId, externalId: v.externalId, displayName: v.displayName, limits: limitsFrom(v) }); route(); }));
  }
  setMain(...kids);
}

async function pageModels() {
  const groups = await listAll('ModelService', 'ListModelGroups', {}, 'modelGroups');
  const deps = await listAll('ModelService', 'ListDeployments', {}, 'deployments');
  const caps = c => { c = c || {}; return [c.tools && 'tools', c.jsonMode && 'json', c.vision && 'vision', c.maxInputTokens && 'in ' + c.maxInputTokens,
    c.maxOutputTokens && 'out ' + c.maxOutputTokens].filter(Boolean).join(' · '); };
  const price = p => { p = p || {}; return 'in $' + ((p.inputPerToken || 0) * 1e6).toFixed(2) + '/M · out $' + ((p.outputPerToken || 0) * 1e6).toFixed(2) + '/M' +
    (p.cachedInputPerToken ? ' · cached $' + (p.cachedInputPerToken * 1e6).toFixed(2) + '/M' : ''); };
  const kids = [el('h1', {}, 'Model groups'),
    table([['name', g => g.name], ['description', g => g.description], ['deployments', g => deps.filter(d => d.modelGroup === g.name).length, 'num']], groups, { test: 'groups' }),
    el('h2', {}, 'Deployments'),
    table([['id', d => d.id], ['group', d => d.modelGroup], ['api base', d => d.apiBase], ['upstream model', d => d.upstreamModel],
      ['weight', d => d.weight || 0, 'num'], ['max concurrency', d => d.maxConcurrency || '∞', 'num'], ['capabilities', d => caps(d.capabilities)],
      ['prices', d => d.free ? 'free' : price(d.prices)], ['tags', d => (d.tags || []).join(',')], ['credential', d => d.hasCredential ? 'set' : 'none']], deps, { test: 'deployments' }),
    el('p', { class: 'muted' }, isPlatform() ? 'Which deployments each data plane keeps out of rotation is on the Health & queues page.' :
      'Class-aware admission settings are on the Traffic classes page.')];
  if (isPlatform() && canWrite()) {
    kids.push(el('h2', {}, 'New model group'), submitForm(el('form', { class: 'inline' }, field('name', input('name')), field('description', input('description'))),
      async v => { await rpc('ModelService', 'CreateModelGroup', v); route(); }));
    kids.push(el('h2', {}, 'New deployment'), submitForm(el('form', { class: 'inline' },
      field('group', el('select', { name: 'modelGroup' }, groups.map(g => el('option', { value: g.name }, g.name)))),
      field('api base', input('apiBase', 'http://host:8000/v1')), field('upstream model', input('upstreamModel')), field('weight', input('weight', '1', 'number')),
      field('max concurrency', input('maxConcurrency', '', 'number')), field('in $/M tokens', input('inPrice', '', 'number')), field('out $/M tokens', input('outPrice', '', 'number'))),
    async v => {
      await rpc('ModelService', 'CreateDeployment', { modelGroup: v.modelGroup, apiBase: v.apiBase, upstreamModel: v.upstreamModel, weight: Number(v.weight || 1),
        maxConcurrency: v.maxConcurrency || undefined, prices: { inputPerToken: Number(v.inPrice || 0) / 1e6, outputPerToken: Number(v.outPrice || 0) / 1e6 } });
      route();
    }));
  }
  setMain(...kids);
}

async function pageFleet() {
  const [planes, ro] = await Promise.all([rpc('FleetService', 'ListDataPlanes', {}), rpc('RolloutService', 'GetRolloutStatus', {})]);
  const latest = ro.latest || {};
  const regions = ro.regions || [];
  const kids = [el('h1', {}, 'Fleet & rollout'),
    el('p', {}, 'Latest config version: ', el('strong', { 'data-test': 'latest' }, latest.version || '0'), ' (', fmtTime(latest.createTime), ')',
      ro.epoch ? ' · distribution epoch ' + (ro.epoch.epoch || 0) : ''),
    el('h2', {}, 'Regions'),
    table([['region', r => r.region.name], ['policy', r => (r.region.policy || '').replace('ROLLOUT_POLICY_', '').toLowerCase()],
      ['current version', r => r.region.currentVersion || '0', 'num'],
      ['instances on version', r => Object.entries((r.dataPlanes || []).reduce((m, d) => { m[d.appliedVersion || 0] = (m[d.appliedVersion || 0] || 0) + 1; return m; }, {}))
        .map(([v, n]) => 'v' + v + ': ' + n).join(', ')],
      ['', r => canWrite() ? el('span', {}, el('input', { class: 'ver', placeholder: 'version', size: 6, value: latest.version || '' }),
        action('Promote', () => rollout('PromoteVersion', r.region.name)),
        action('Roll back', async () => rollout('RollbackRegion', r.region.name))) : '']], regions.map(r => Object.assign({ id: r.region.name }, r)), { test: 'regions' }),
    el('h2', {}, 'Data planes'),
    table([['instance', d => d.instanceId], ['region', d => d.region], ['applied version', d => d.appliedVersion || '0', 'num'], ['events seq', d => d.eventsSeq || '0', 'num'],
      ['health', d => d.health], ['in flight', d => d.inFlight || '0', 'num'], ['staleness s', d => Number(d.stalenessSeconds || 0).toFixed(1), 'num'],
      ['last seen', d => fmtTime(d.lastSeen)], ['rejecting', d => d.rejecting ? 'v' + d.rejecting.version + ': ' + d.rejecting.reason : '']], planes.dataPlanes || [], { test: 'planes' })];
  setMain(...kids);
}
async function rollout(method, region) {
  const v = document.querySelector('tr[data-id="' + CSS.escape(region) + '"] input.ver').value.trim();
  await rpc('RolloutService', method, { region: region, version: v });
  route();
}

async function pageAlerts() {
  const alerts = await listAll('AlertService', 'ListAlerts', isPlatform() ? {} : isTeam() ? { orgId: myOrg(), teamId: who().teamId } : { orgId: myOrg() }, 'alerts', 500);
  setMain(el('h1', {}, 'Budget alerts'),
    table([['time', a => fmtTime(a.time)], ['scope', a => a.scopeKind + ' ' + a.scopeId], ['threshold', a => (a.thresholdPercent || 0) + '%', 'num'],
      ['spend', a => usd(a.spendUsd), 'num'], ['cap', a => usd(a.capUsd), 'num'], ['window', a => (a.budgetDuration || '') + ' from ' + fmtTime(a.windowStart)],
      ['region', a => a.region]], alerts, { test: 'alerts' }));
}

async function pageAudit() {
  const result = el('div', { 'data-test': 'verify-result' });
  const body = el('tbody', {});
  let next = '';
  const more = el('button', { type: 'button' }, 'More');
  async function load() {
    const r = await rpc('AuditService', 'ListAuditEvents', { pageSize: 100, pageToken: next, orgId: isPlatform() ? '' : myOrg() });
    for (const e of r.events || []) {
      body.append(el('tr', { 'data-id': e.seq }, el('td', { class: 'num' }, e.seq), el('td', {}, fmtTime(e.time)), el('td', {}, ref(e.actor)), el('td', {}, e.action),
        el('td', {}, e.objectType + ' ', ref(e.objectId)), el('td', {}, ref(e.orgId)), el('td', {}, ref(e.teamId))));
    }
    next = r.nextPageToken || '';
    more.hidden = !next;
  }
  more.addEventListener('click', load);
  const verify = action('Verify chain', async () => {
    result.replaceChildren('verifying…');
    let tok = '', checked = 0;
    for (;;) {
      const r = await rpc('AuditService', 'VerifyAuditChain', { pageToken: tok });
      checked += Number(r.checked || 0);
      if (!r.ok) { result.replaceChildren(el('span', { class: 'error' }, 'Chain broken at seq ' + r.brokenSeq + ': ' + r.problem)); return; }
      tok = r.nextPageToken || '';
      if (!tok) break;
    }
    result.replaceChildren(el('span', { class: 'ok' }, 'Chain verified: ' + checked + ' events, every hash matches.'));
  }, { 'data-test': 'verify' });
  setMain(el('h1', {}, 'Audit log'), el('div', { class: 'toolbar' }, verify, result),
    el('table', { 'data-test': 'audit' }, el('thead', {}, el('tr', {}, ['seq', 'time', 'actor', 'action', 'object', 'org', 'team'].map(h => el('th', {}, h)))), body), more);
  await load();
}

// ---- spend plots (inline SVG) ----
const COLORS = ['#3b6fd6', '#e07b39', '#2f9e6e', '#b84fb1', '#c9a227', '#5aa7c7', '#b3261e', '#7a7f8c'];
const SVGNS = 'http://www.w3.org/2000/svg';
function svg(tag, attrs, ...kids) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return e;
}
function dayKey(t) { return new Date(t).toISOString().slice(0, 10); }
function lastDays(n) { const out = []; const now = Date.now(); for (let i = n - 1; i >= 0; i--) out.push(dayKey(now - i * 86400000)); return out; }

// stackedBars draws one bar per day, stacked by series (top 7 + other).
function stackedBars(title, days, series, fmt, test, label) {
  label = label || (d => d.slice(5));
  const names = Object.keys(series).sort((a, b) => total(series[b]) - total(series[a]));
  let shown = names.slice(0, 7);
  const merged = {};
  for (const n of shown) merged[n] = series[n];
  if (names.length > 7) {
    merged.other = {};
    for (const n of names.slice(7)) for (const [d, v] of Object.entries(series[n])) merged.other[d] = (merged.other[d] || 0) + v;
    shown = shown.concat(['other']);
  }
  const W = 720, H = 220, L = 60, B = 30, T = 10;
  const max = Math.max(1e-9, ...days.map(d => shown.reduce((s, n) => s + (merged[n][d] || 0), 0)));
  const bw = (W - L - 10) / days.length;
  const g = svg('svg', { width: W, height: H, viewBox: '0 0 ' + W + ' ' + H, class: 'plot', 'data-test': test, role: 'img', 'aria-label': title });
  for (let i = 0; i <= 4; i++) {
    const y = T + (H - T - B) * (1 - i / 4);
    g.append(svg('line', { x1: L, x2: W - 10, y1: y, y2: y, stroke: '#e3e6ec' }), svg('text', { x: L - 4, y: y + 4, 'text-anchor': 'end' }, fmt(max * i / 4)));
  }
  days.forEach((d, i) => {
    let y = H - B;
    shown.forEach((n, j) => {
      const v = merged[n][d] || 0;
      if (v <= 0) return;
      const h = (H - T - B) * v / max;
      y -= h;
      g.append(svg('rect', { x: L + i * bw + 2, y: y, width: Math.max(1, bw - 4), height: h, fill: COLORS[j % COLORS.length], 'data-series': n },
        svg('title', {}, d + ' ' + n + ': ' + fmt(v))));
    });
    if (days.length <= 16 || i % 2 === 0) g.append(svg('text', { x: L + i * bw + bw / 2, y: H - B + 14, 'text-anchor': 'middle' }, label(d)));
  });
  const legend = el('div', { class: 'legend' }, shown.map((n, j) => { const s = el('span', {}, n + ' ' + fmt(total(merged[n]))); s.style.setProperty('--c', COLORS[j % COLORS.length]); return s; }));
  return el('div', {}, el('h2', {}, title), legend, g);
}
function total(m) { return Object.values(m).reduce((a, b) => a + b, 0); }
function add(series, name, day, v) { (series[name] = series[name] || {})[day] = (series[name][day] || 0) + v; }

async function spendPlots(box, ndays) {
  box.replaceChildren(el('p', { class: 'muted' }, 'loading spend…'));
  const days = lastDays(ndays);
  const start = new Date(Date.parse(days[0] + 'T00:00:00Z')).toISOString();
  const filter = isPlatform() ? {} : isTeam() ? { orgId: myOrg(), teamId: who().teamId } : { orgId: myOrg() };
  let logs;
  try { logs = await listAll('SpendService', 'ListSpendLogs', Object.assign({ startTime: start }, filter), 'logs', 20000); } catch (e) { box.replaceChildren(errBox(e)); return; }
  const byTeam = {}, byKey = {}, byGroup = {}, reqs = {};
  // Names for the legends; ids where this token cannot list them.
  const keyNames = {}, teamNames = {};
  try { for (const k of await listAll('KeyService', 'ListKeys', filter, 'keys')) keyNames[k.id] = k.alias || k.id; } catch (e) { /* ids only */ }
  try { for (const t of await teamsOf(isPlatform() ? '' : myOrg())) teamNames[t.id] = t.name; } catch (e) { /* ids only */ }
  for (const l of logs) {
    const d = dayKey(l.time), c = Number(l.costUsd || 0);
    add(byTeam, teamNames[l.teamId] || l.teamId || '(no team)', d, c);
    add(byKey, keyNames[l.keyId] || l.keyId || '(no key)', d, c);
    add(byGroup, l.modelGroup || '(none)', d, c);
    const ok = (l.status || 0) >= 200 && (l.status || 0) < 300;
    add(reqs, ok ? 'served' : 'rejected ' + (l.errorCode || l.status || ''), d, 1);
  }
  const money = usd;
  const count = v => String(Math.round(v));
  box.replaceChildren(
    el('p', { class: 'muted', 'data-test': 'spend-count' }, logs.length + ' requests in the last ' + ndays + ' days (from the spend ledger).'),
    stackedBars('Spend per day by team', days, byTeam, money, 'plot-team'),
    stackedBars('Spend per day by key', days, byKey, money, 'plot-key'),
    stackedBars('Spend per day by model group', days, byGroup, money, 'plot-group'),
    stackedBars('Requests and rejections per day', days, reqs, count, 'plot-requests'));
}

// budgetWindowStart mirrors internal/budget.Window: <n>h and <n>d aligned
// to the Unix epoch, <n>mo runs of months counted from January 1970 (UTC).
function budgetWindowStart(w, now) {
  const m = /^([1-9][0-9]{0,3})(h|d|mo)$/.exec(w || '');
  if (!m) return null;
  const n = Number(m[1]);
  if (m[2] !== 'mo') { const len = n * (m[2] === 'h' ? 3600 : 86400) * 1000; return new Date(Math.floor(now / len) * len); }
  const d = new Date(now), months = (d.getUTCFullYear() - 1970) * 12 + d.getUTCMonth(), sm = Math.floor(months / n) * n;
  return new Date(Date.UTC(1970 + Math.floor(sm / 12), sm % 12, 1));
}

async function budgetBurn(box) {
  const filter = isPlatform() ? {} : isTeam() ? { orgId: myOrg(), teamId: who().teamId } : { orgId: myOrg() };
  const scopes = [];
  if (!isTeam()) for (const o of isPlatform() ? await listAll('OrgService', 'ListOrgs', {}, 'orgs') : [(await rpc('OrgService', 'GetOrg', { id: myOrg() })).org]) scopes.push(['SPEND_SCOPE_ORG', 'org', o, o.name]);
  for (const t of await teamsOf(isPlatform() ? '' : myOrg())) scopes.push(['SPEND_SCOPE_TEAM', 'team', t, t.name]);
  for (const k of await listAll('KeyService', 'ListKeys', filter, 'keys')) scopes.push(['SPEND_SCOPE_KEY', 'key', k, k.alias || k.id]);
  const rows = [];
  for (const [scope, kind, obj, name] of scopes) {
    const l = obj.limits || {};
    if (l.maxBudget === undefined && l.softBudget === undefined) continue;
    const start = budgetWindowStart(l.budgetDuration || '', Date.now()) || new Date(0);
    const r = await rpc('SpendService', 'GetSpend', { scope: scope, id: obj.id, orgId: obj.orgId || obj.id, startTime: start.toISOString() });
    rows.push({ id: obj.id, kind: kind, name: name, spent: Number(r.spendUsd || 0), cap: l.maxBudget, soft: l.softBudget, window: l.budgetDuration || 'lifetime', start: start });
  }
  box.replaceChildren(el('h2', {}, 'Budget burn against cap (current window)'),
    table([['scope', r => r.kind + ' ' + r.name], ['window', r => r.window + (r.window !== 'lifetime' ? ' since ' + fmtTime(r.start) : '')],
      ['spent', r => usd(r.spent), 'num'], ['cap', r => r.cap !== undefined ? usd(r.cap) : '', 'num'], ['soft', r => r.soft !== undefined ? usd(r.soft) : '', 'num'],
      ['burn', r => { if (r.cap === undefined) return ''; const pct = r.cap > 0 ? 100 * r.spent / r.cap : 100; const b = el('div', { class: pct >= 100 ? 'over' : '' }); b.style.width = Math.min(100, pct) + '%';
        return el('span', {}, el('div', { class: 'bar' }, b), pct.toFixed(1) + '%'); }]], rows, { test: 'burn' }));
}

async function pageSpend() {
  const plots = el('div', {}), burn = el('div', {});
  const sel = el('select', { 'data-test': 'days' }, [7, 14, 30].map(n => el('option', { value: n }, 'last ' + n + ' days')));
  sel.addEventListener('change', () => spendPlots(plots, Number(sel.value)));
  setMain(el('h1', {}, 'Spend'), el('div', { class: 'toolbar' }, sel), burn, plots);
  await Promise.all([spendPlots(plots, 7), budgetBurn(burn).catch(e => burn.replaceChildren(errBox(e)))]);
}

// ---- shell ----
async function route() {
  if (!S.who) return;
  const name = (location.hash.replace(/^#\/?/, '') || 'overview');
  const page = PAGES.find(p => p[0] === name && p[2]()) || PAGES[0];
  for (const a of document.querySelectorAll('#nav a')) a.classList.toggle('active', a.dataset.page === page[0]);
  document.body.dataset.page = page[0];
  document.body.dataset.ready = '';
  try { await page[3](); } catch (e) {
    if (e.code === 'unauthenticated') { logout(); return; }
    main().append(errBox(e));
  }
  document.body.dataset.ready = page[0];
}

function renderNav() {
  const nav = document.getElementById('nav');
  nav.replaceChildren(...PAGES.filter(p => p[2]()).map(p => el('a', { href: '#/' + p[0], 'data-page': p[0] }, p[1])));
  nav.hidden = false;
  const w = S.who;
  document.getElementById('who').textContent = (w.name || w.principal) + ' · ' + (w.scope || '').replace('SCOPE_', '').toLowerCase() +
    (w.orgId ? ' ' + w.orgId : '') + (w.teamId ? ' / ' + w.teamId : '') + ' · ' + (w.role || '').replace('ROLE_', '').toLowerCase();
  document.getElementById('logout').hidden = false;
}

function logout() {
  sessionStorage.removeItem(TOKEN_KEY);
  location.hash = '';
  location.reload();
}

async function login(tok) {
  S.token = tok;
  S.who = await rpc('AdminTokenService', 'WhoAmI', {});
  sessionStorage.setItem(TOKEN_KEY, tok);
  renderNav();
  await route();
}

document.addEventListener('DOMContentLoaded', () => {
  document.getElementById('logout').addEventListener('click', logout);
  document.getElementById('login-form').addEventListener('submit', async ev => {
    ev.preventDefault();
    const input = document.getElementById('token');
    const tok = input.value.trim();
    input.value = '';
    try { await login(tok); } catch (e) { S.token = ''; document.getElementById('login-error').textContent = e.message; }
  });
  window.addEventListener('hashchange', route);
  if (S.token) login(S.token).catch(() => { sessionStorage.removeItem(TOKEN_KEY); S.token = ''; });
});
