package system

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/controlplane"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	"github.com/sluicegw/sluice/internal/testsvc"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

// These tests drive the usage ledger through the real request path: the
// proxy answers OpenAI requests from vLLM simulators, publishes one usage
// event per request, and the control plane's spend consumer writes them to
// spend_logs and spend_daily — also while its Postgres is unreachable or
// the control plane is down.

// pgCut forwards TCP connections to Postgres and can cut them all, making
// the database unreachable for the control plane while the test still
// reaches it directly.
type pgCut struct {
	ln      net.Listener
	backend string
	mu      sync.Mutex
	down    bool
	conns   map[net.Conn]bool
}

// startPGCut returns a forwarder to the database of dbURL and dbURL
// rewritten to go through it.
func startPGCut(t testing.TB, dbURL string) (*pgCut, string) {
	t.Helper()
	u, err := url.Parse(dbURL)
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	c := &pgCut{ln: ln, backend: u.Host, conns: map[net.Conn]bool{}}
	t.Cleanup(func() { _ = ln.Close(); c.setDown(true) })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go c.serve(conn)
		}
	}()
	u.Host = ln.Addr().String()
	return c, u.String()
}

func (c *pgCut) track(conn net.Conn) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.down {
		_ = conn.Close()
		return false
	}
	c.conns[conn] = true
	return true
}

func (c *pgCut) serve(conn net.Conn) {
	if !c.track(conn) {
		return
	}
	b, err := net.Dial("tcp", c.backend)
	if err != nil || !c.track(b) {
		_ = conn.Close()
		return
	}
	go func() { _, _ = io.Copy(b, conn); _ = b.Close() }()
	_, _ = io.Copy(conn, b)
	_ = conn.Close()
}

// setDown cuts every connection and refuses new ones (down), or lets them
// through again.
func (c *pgCut) setDown(down bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.down = down
	if down {
		for conn := range c.conns {
			_ = conn.Close()
		}
		c.conns = map[net.Conn]bool{}
	}
}

// startControlDB is startControl on another database URL.
func (d *dist) startControlDB(instance, dbURL string) string {
	d.T.Helper()
	return d.StartControlConfig(controlplane.Config{DatabaseURL: dbURL, InstanceID: instance,
		Publish: controlplane.PublishConfig{Debounce: 50 * time.Millisecond, TickInterval: 200 * time.Millisecond}})
}

func (d *dist) customerClient() adminv1connect.CustomerServiceClient {
	return adminv1connect.NewCustomerServiceClient(http.DefaultClient, d.Admin, connect.WithInterceptors(harness.BearerInterceptor(testBootstrap)))
}

// Prices of the test deployments (USD per token).
var (
	fastPrices = &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 3e-6, CachedInputPerToken: 0.25e-6}
	slowPrices = &adminv1.Prices{InputPerToken: 2e-6, OutputPerToken: 5e-6} // cached tokens at the input price
)

// priceOf is the documented cost rule (docs/proxy.md): uncached prompt
// tokens at the input price, cached ones at the cached-input price (the
// input price when unset), completion tokens at the output price.
func priceOf(p *adminv1.Prices, prompt, cached, completion int64) float64 {
	cp := p.CachedInputPerToken
	if cp == 0 {
		cp = p.InputPerToken
	}
	return float64(prompt-cached)*p.InputPerToken + float64(cached)*cp + float64(completion)*p.OutputPerToken
}

// Kinds of ledger test requests.
const (
	kChat         = "chat"
	kStreamUsage  = "stream_usage"
	kStreamPlain  = "stream_plain" // the client does not ask for usage
	kCompletion   = "completion"
	kEmbedding    = "embedding"
	kUnknownModel = "unknown_model"
	kBlockedKey   = "blocked_key"
	kBlockedCust  = "blocked_customer"
	kUnknownKey   = "unknown_key"
	kCancelled    = "cancelled"
)

// roundMix is the requests of one round (60).
var roundMix = []struct {
	kind string
	n    int
}{
	{kChat, 12}, {kStreamUsage, 10}, {kStreamPlain, 4}, {kCompletion, 6}, {kEmbedding, 6},
	{kUnknownModel, 3}, {kBlockedKey, 3}, {kBlockedCust, 3}, {kUnknownKey, 3}, {kCancelled, 10},
}

const (
	cancelAfterChunks = 3
	cancelMaxTokens   = 400
)

// usageSeen is the usage the client received.
type usageSeen struct {
	PromptTokens        int64 `json:"prompt_tokens"`
	CompletionTokens    int64 `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func (u *usageSeen) cached() int64 {
	if u == nil || u.PromptTokensDetails == nil {
		return 0
	}
	return u.PromptTokensDetails.CachedTokens
}

// sent is one request as the client saw it.
type sent struct {
	kind, id, customer string
	status             int
	code               string     // error code of a refusal
	usage              *usageSeen // usage the client received, if any
	textChunks         int64      // stream chunks with text the client read
	sawDone            bool
}

// ledgerRig is the system under test of TestLedgerThroughTheProxy.
type ledgerRig struct {
	t          *testing.T
	d          *dist
	p          *proxy
	fast, slow *vllmsim.Server
	org, team  string
	user       string
	tok        string // the tenant's key (tags ledger, e2e)
	keyID      string
	blockedTok string
	fastDep    string
	slowDep    string
	system     string // shared system prompt: prefix-cache hits
}

func (r *ledgerRig) do(ctx context.Context, route, tok, body string, hdr map[string]string) *http.Response {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.p.URL+route, strings.NewReader(body))
	require.NoError(r.t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+tok)
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(r.t, err)
	require.NotEmpty(r.t, resp.Header.Get(dataplane.RequestIDHeader), "every answer carries a request id")
	return resp
}

func chatJSON(model, system, user string, maxTokens int, extra string) string {
	m, _ := json.Marshal([]map[string]string{{"role": "system", "content": system}, {"role": "user", "content": user}})
	b := fmt.Sprintf(`{"model":%q,"messages":%s,"max_tokens":%d`, model, m, maxTokens)
	if extra != "" {
		b += "," + extra
	}
	return b + "}"
}

// readSSE reads a stream: the usage chunk, text chunks and [DONE]. With
// stopAfter > 0 it returns after that many text chunks.
func readSSE(t testing.TB, body io.Reader, stopAfter int64) (u *usageSeen, text int64, done bool) {
	t.Helper()
	br := bufio.NewReader(body)
	for {
		line, err := br.ReadString('\n')
		if v, ok := strings.CutPrefix(strings.TrimRight(line, "\r\n"), "data: "); ok {
			if v == "[DONE]" {
				done = true
			} else {
				var ch struct {
					Choices []struct {
						Delta struct {
							Content string `json:"content"`
						} `json:"delta"`
					} `json:"choices"`
					Usage *usageSeen `json:"usage"`
					Error any        `json:"error"`
				}
				require.NoError(t, json.Unmarshal([]byte(v), &ch), "%s", v)
				require.Nil(t, ch.Error, "stream error event %s", v)
				if ch.Usage != nil {
					u = ch.Usage
				}
				if len(ch.Choices) > 0 && ch.Choices[0].Delta.Content != "" {
					text++
					if stopAfter > 0 && text >= stopAfter {
						return u, text, done
					}
				}
			}
		}
		if err != nil {
			require.ErrorIs(t, err, io.EOF)
			return u, text, done
		}
	}
}

// send performs request i of kind and reports what the client saw.
func (r *ledgerRig) send(kind string, i int) *sent {
	t := r.t
	ctx := context.Background()
	s := &sent{kind: kind}
	hdr := map[string]string{dataplane.HeaderAgentID: "agent-ledger", dataplane.HeaderSession: fmt.Sprintf("sess-%d", i%5)}
	if i%3 != 0 {
		s.customer = fmt.Sprintf("cust-%d", i%2) // unknown to the org: attribution only
		hdr[dataplane.HeaderEndUser] = s.customer
	}
	user := fmt.Sprintf("Question %d: what does the gateway do with request number %d?", i, i)
	tok, route, body := r.tok, dataplane.RouteChat, chatJSON("qwen", r.system, user, 24, "")
	switch kind {
	case kStreamUsage:
		body = chatJSON("qwen", r.system, user, 24, `"stream":true,"stream_options":{"include_usage":true}`)
	case kStreamPlain:
		body = chatJSON("qwen", r.system, user, 24, `"stream":true`)
	case kCompletion:
		route, body = dataplane.RouteCompletions, fmt.Sprintf(`{"model":"qwen","prompt":%q,"max_tokens":12}`, r.system+user)
	case kEmbedding:
		route, body = dataplane.RouteEmbeddings, fmt.Sprintf(`{"model":"qwen","input":%q}`, user)
	case kUnknownModel:
		body = chatJSON("no-such-model", r.system, user, 24, "")
	case kBlockedKey:
		tok = r.blockedTok
		s.customer = "" // attribution headers are read after the key
	case kBlockedCust:
		s.customer = "cust-blocked"
		hdr[dataplane.HeaderEndUser] = s.customer
	case kUnknownKey:
		tok, s.customer = "sk-sluice-not-a-key", ""
	case kCancelled:
		body = chatJSON("slow", r.system, user, cancelMaxTokens, `"stream":true,"stream_options":{"include_usage":true},"ignore_eos":true`)
	}
	if kind == kCancelled {
		cctx, cancel := context.WithCancel(ctx)
		resp := r.do(cctx, route, tok, body, hdr)
		s.id, s.status = resp.Header.Get(dataplane.RequestIDHeader), resp.StatusCode
		require.Equal(t, http.StatusOK, resp.StatusCode)
		s.usage, s.textChunks, s.sawDone = readSSE(t, resp.Body, cancelAfterChunks)
		require.False(t, s.sawDone, "the stream ended before the client cancelled it")
		require.Nil(t, s.usage)
		cancel()
		_ = resp.Body.Close()
		s.status, s.code = dataplane.StatusClientClosed, dataplane.CodeClientClosed
		return s
	}
	resp := r.do(ctx, route, tok, body, hdr)
	defer resp.Body.Close()
	s.id, s.status = resp.Header.Get(dataplane.RequestIDHeader), resp.StatusCode
	if kind == kStreamUsage || kind == kStreamPlain {
		require.Equal(t, http.StatusOK, resp.StatusCode)
		s.usage, s.textChunks, s.sawDone = readSSE(t, resp.Body, 0)
		require.True(t, s.sawDone)
		if kind == kStreamUsage {
			require.NotNil(t, s.usage, "asked for usage")
		} else {
			require.Nil(t, s.usage, "the usage chunk is stripped for a client that did not ask")
		}
		return s
	}
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	var out struct {
		Usage *usageSeen `json:"usage"`
		Error struct {
			Code string `json:"code"`
		} `json:"error"`
	}
	require.NoError(t, json.Unmarshal(b, &out), "%s", b)
	s.usage, s.code = out.Usage, out.Error.Code
	want := map[string]struct {
		status int
		code   string
	}{
		kChat: {200, ""}, kCompletion: {200, ""}, kEmbedding: {200, ""},
		kUnknownModel: {404, dataplane.CodeModelNotFound}, kBlockedKey: {403, "key_blocked"},
		kBlockedCust: {403, dataplane.CodeCustomerBlocked}, kUnknownKey: {401, dataplane.CodeInvalidAPIKey},
	}[kind]
	require.Equal(t, want.status, s.status, "%s: %s", kind, b)
	require.Equal(t, want.code, s.code, kind)
	if s.status == http.StatusOK {
		require.NotNil(t, s.usage, "%s: %s", kind, b)
	}
	return s
}

// round sends one mix of requests from 6 concurrent clients; mid runs
// once half of them are answered.
func (r *ledgerRig) round(base int, mid func()) []*sent {
	var jobs []string
	for _, m := range roundMix {
		for range m.n {
			jobs = append(jobs, m.kind)
		}
	}
	// Interleave kinds so every phase of the round sees every kind.
	for i := range jobs {
		j := (i * 37) % len(jobs)
		jobs[i], jobs[j] = jobs[j], jobs[i]
	}
	out := make([]*sent, len(jobs))
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		answers int
		midOnce sync.Once
	)
	// Buffered and closed up front: a worker stopped by a failed require
	// (runtime.Goexit) cannot block the others.
	next := make(chan int, len(jobs))
	for i := range jobs {
		next <- i
	}
	close(next)
	for range 6 {
		wg.Go(func() {
			for i := range next {
				s := r.send(jobs[i], base+i)
				mu.Lock()
				out[i] = s
				answers++
				half := answers == len(jobs)/2
				mu.Unlock()
				if half && mid != nil {
					midOnce.Do(mid)
				}
			}
		})
	}
	wg.Wait()
	if r.t.Failed() {
		r.t.FailNow()
	}
	return out
}

// spendRow is one spend_logs row.
type spendRow struct {
	id, day, org, team, user, key, customer, agent, session, route, group, dep, code, project string
	tags                                                                                      []string
	stream                                                                                    bool
	prompt, completion, cached                                                                int64
	cost                                                                                      float64
	status                                                                                    int32
}

func (d *dist) spendRows(t testing.TB) map[string]*spendRow {
	t.Helper()
	out := map[string]*spendRow{}
	d.pg(t, func(ctx context.Context, conn *pgx.Conn) {
		rows, err := conn.Query(ctx, `SELECT request_id, to_char((at AT TIME ZONE 'UTC')::date, 'YYYY-MM-DD'), org_id, team_id,
			user_id, key_id, customer, agent_id, session_id, route, model_group, deployment_id, error_code, tags, stream,
			prompt_tokens, completion_tokens, cached_tokens, cost_usd, status, project FROM spend_logs`)
		require.NoError(t, err)
		for rows.Next() {
			var r spendRow
			require.NoError(t, rows.Scan(&r.id, &r.day, &r.org, &r.team, &r.user, &r.key, &r.customer, &r.agent, &r.session,
				&r.route, &r.group, &r.dep, &r.code, &r.tags, &r.stream, &r.prompt, &r.completion, &r.cached, &r.cost, &r.status, &r.project))
			out[r.id] = &r
		}
		require.NoError(t, rows.Err())
	})
	return out
}

func (d *dist) spendRowCount(t testing.TB) int {
	var n int
	d.pg(t, func(ctx context.Context, conn *pgx.Conn) {
		require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM spend_logs`).Scan(&n))
	})
	return n
}

type dailyKey struct{ day, scope, id, org string }

type dailySums struct {
	requests, prompt, completion, cached int64
	cost                                 float64
}

// expectedDaily aggregates rows the way spend_daily is documented to
// (docs/ledger.md): per UTC day, scope, id and org; empty ids skipped;
// each distinct tag once; the project (from migration 0013 on).
func expectedDaily(rows map[string]*spendRow) map[dailyKey]*dailySums {
	out := map[dailyKey]*dailySums{}
	for _, r := range rows {
		scopes := [][2]string{{"org", r.org}, {"team", r.team}, {"user", r.user}, {"key", r.key}, {"customer", r.customer},
			{"model_group", r.group}, {"deployment", r.dep}, {"project", r.project}}
		seen := map[string]bool{}
		for _, tag := range r.tags {
			if !seen[tag] {
				seen[tag] = true
				scopes = append(scopes, [2]string{"tag", tag})
			}
		}
		for _, s := range scopes {
			if s[1] == "" {
				continue
			}
			k := dailyKey{r.day, s[0], s[1], r.org}
			a := out[k]
			if a == nil {
				a = &dailySums{}
				out[k] = a
			}
			a.requests++
			a.prompt += r.prompt
			a.completion += r.completion
			a.cached += r.cached
			a.cost += r.cost
		}
	}
	return out
}

func (d *dist) spendDaily(t testing.TB) map[dailyKey]*dailySums {
	t.Helper()
	out := map[dailyKey]*dailySums{}
	d.pg(t, func(ctx context.Context, conn *pgx.Conn) {
		rows, err := conn.Query(ctx, `SELECT to_char(day, 'YYYY-MM-DD'), scope, scope_id, org_id, requests, prompt_tokens,
			completion_tokens, cached_tokens, cost_usd FROM spend_daily`)
		require.NoError(t, err)
		for rows.Next() {
			var k dailyKey
			var s dailySums
			require.NoError(t, rows.Scan(&k.day, &k.scope, &k.id, &k.org, &s.requests, &s.prompt, &s.completion, &s.cached, &s.cost))
			out[k] = &s
		}
		require.NoError(t, rows.Err())
	})
	return out
}

// settle waits until spend_logs holds want rows and the spend consumer
// has nothing pending or unacknowledged (so a redelivered copy would have
// been applied by now), then checks that nothing more arrives.
func (r *ledgerRig) settle(want int, within time.Duration) {
	t := r.t
	t.Helper()
	_, js := r.d.js(t)
	settled := func() bool {
		if r.d.spendRowCount(t) < want {
			return false
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		c, err := js.Consumer(ctx, "SLUICE_USAGE", "sluice-spend")
		if err != nil {
			return false
		}
		info, err := c.Info(ctx)
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0
	}
	if !harness.Until(settled, within, 50*time.Millisecond) {
		t.Fatalf("spend_logs has %d rows, want %d; usage publisher %+v; spend consumer: %s",
			r.d.spendRowCount(t), want, r.p.DP.UsageStats(), r.d.spendConsumerInfo())
	}
	time.Sleep(300 * time.Millisecond)
	require.Equal(t, want, r.d.spendRowCount(t), "exactly one row per request")
}

func setupLedgerRig(t *testing.T) (*ledgerRig, *pgCut, string) {
	d := &dist{&harness.Dist{T: t, NATS: testsvc.StartNATS(t), DatabaseURL: testsvc.NewDatabase(t)}}
	cut, via := startPGCut(t, d.DatabaseURL)
	d.Admin = d.startControlDB("cp-1", via)
	r := &ledgerRig{t: t, d: d, system: vllmsim.FillerText(7, 80)}

	fastCfg := vllmsim.DefaultConfig()
	fastCfg.Addr, fastCfg.TimeScale, fastCfg.MeanOutputTokens = "127.0.0.1:0", 20, 16
	slowCfg := vllmsim.DefaultConfig() // real time: 10 ms per token, streams outlast the client's patience
	slowCfg.Addr = "127.0.0.1:0"
	for _, s := range []struct {
		cfg vllmsim.Config
		dst **vllmsim.Server
	}{{fastCfg, &r.fast}, {slowCfg, &r.slow}} {
		sim := harness.StartSim(t, s.cfg)
		*s.dst = sim
	}

	ctx := context.Background()
	m := d.modelClient()
	for _, g := range []struct {
		name   string
		sim    *vllmsim.Server
		prices *adminv1.Prices
		dep    *string
	}{{"qwen", r.fast, fastPrices, &r.fastDep}, {"slow", r.slow, slowPrices, &r.slowDep}} {
		_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: g.name, PlatformWide: true}))
		require.NoError(t, err)
		dep, err := m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
			ModelGroup: g.name, ApiBase: g.sim.URL() + "/v1", UpstreamModel: vllmsim.DefaultModel, Weight: 1, Prices: g.prices}))
		require.NoError(t, err)
		*g.dep = dep.Msg.Deployment.Id
	}

	ten := d.NewTenant("ledger")
	r.org, r.team, r.user = ten.OrgID, ten.TeamID, ten.UserID
	c := d.Clients()
	k, err := c.Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: ten.OrgID, TeamId: ten.TeamID, UserId: ten.UserID,
		Tags: []string{"ledger", "e2e"}}))
	require.NoError(t, err)
	r.tok, r.keyID = k.Msg.Token, k.Msg.Key.Id
	blk, err := c.Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: ten.OrgID, TeamId: ten.TeamID}))
	require.NoError(t, err)
	_, err = c.Key.BlockKey(ctx, connect.NewRequest(&adminv1.BlockKeyRequest{Id: blk.Msg.Key.Id}))
	require.NoError(t, err)
	r.blockedTok = blk.Msg.Token
	cu, err := d.customerClient().CreateCustomer(ctx, connect.NewRequest(&adminv1.CreateCustomerRequest{OrgId: ten.OrgID, ExternalId: "cust-blocked"}))
	require.NoError(t, err)
	_, err = d.customerClient().BlockCustomer(ctx, connect.NewRequest(&adminv1.BlockCustomerRequest{Id: cu.Msg.Customer.Id}))
	require.NoError(t, err)

	// The proxy may go an hour without the control plane: this test takes
	// the control plane away, and requests must go on being served.
	r.p = d.StartProxy("default", time.Hour)
	harness.Eventually(t, func() bool {
		cat := r.p.DP.Catalog()
		return len(cat.Deployments("qwen")) == 1 && len(cat.Deployments("slow")) == 1 &&
			cat.Customer(ten.OrgID, "cust-blocked").GetBlocked()
	}, 10*time.Second, 10*time.Millisecond)
	harness.WaitStatus(t, r.p, r.blockedTok, http.StatusForbidden, 10*time.Second)
	harness.WaitStatus(t, r.p, r.tok, http.StatusOK, 10*time.Second)
	return r, cut, via
}

// withRows counts the requests of all that make a ledger row: all but
// those without a valid key (refused before authentication, only counted
// in sluice_proxy_preauth_refusals_total).
func withRows(all []*sent) int {
	n := 0
	for _, s := range all {
		if s.kind != kUnknownKey {
			n++
		}
	}
	return n
}

// TestLedgerThroughTheProxy is issue 4's ledger must-show: N requests
// through the proxy — chat (streaming or not), completions, embeddings,
// refusals and client-cancelled streams — make exactly N spend_logs rows
// (but for the requests without a valid key, which make none)
// with the request ids the clients received; tokens equal the usage the
// upstream reported; cost = tokens × price; spend_daily equals the sums of
// spend_logs per scope. One round runs with the control plane's Postgres
// cut off in its middle, another with the control plane stopped; after
// recovery the same exactness holds.
func TestLedgerThroughTheProxy(t *testing.T) {
	t.Parallel()
	r, cut, via := setupLedgerRig(t)
	d := r.d
	var all []*sent
	t0 := time.Now()

	// Round 1: everything up.
	all = append(all, r.round(0, nil)...)
	answered := time.Now()
	r.settle(withRows(all), 30*time.Second)
	t.Logf("round 1: %d requests answered in %s, all recorded %s later", len(all),
		answered.Sub(t0).Round(time.Millisecond), time.Since(answered).Round(time.Millisecond))

	// Round 2: Postgres becomes unreachable for the control plane halfway
	// through; the proxy keeps serving and publishing, the consumer's
	// transactions fail and its batches are redelivered.
	var cutAt time.Time
	all = append(all, r.round(1000, func() { cutAt = time.Now(); cut.setDown(true) })...)
	time.Sleep(2 * time.Second) // the consumer retries against the dead database
	during := d.spendRowCount(t)
	require.Less(t, during, withRows(all), "requests after the cut cannot have reached Postgres")
	cut.setDown(false)
	restored := time.Now()
	r.settle(withRows(all), 60*time.Second)
	t.Logf("round 2: Postgres unreachable for %s; %d of %d rows were in before it came back; all recorded %s after",
		restored.Sub(cutAt).Round(time.Millisecond), during, len(all), time.Since(restored).Round(time.Millisecond))

	// Round 3: the only control plane (and its spend consumer) stops
	// halfway through; another replica starts after the round.
	all = append(all, r.round(2000, func() { d.Controls[0]() })...)
	time.Sleep(time.Second)
	// A stopping consumer records the batch it holds before it exits, so
	// how many rows are in now depends on timing; the rest waits in the
	// stream for the next replica.
	during = d.spendRowCount(t)
	require.LessOrEqual(t, during, len(all))
	restart, consumer := time.Now(), d.spendConsumerInfo()
	d.Admin = d.startControlDB("cp-2", via)
	r.settle(withRows(all), 30*time.Second)
	t.Logf("round 3: control plane stopped; %d of %d rows before a new replica started (spend consumer: %s); all recorded %s after its start",
		during, len(all), consumer, time.Since(restart).Round(time.Millisecond))

	st := r.p.DP.UsageStats()
	require.Zero(t, st.Dropped)
	require.Zero(t, st.Buffered)

	// Exactly one row per request, with the id the client received.
	rows := d.spendRows(t)
	require.Len(t, rows, withRows(all))
	kinds := map[string]int{}
	var fastPrompt, fastCompletion, cachedRows, cancelledPrompt, cancelledCompletion int64
	for _, s := range all {
		kinds[s.kind]++
		row := rows[s.id]
		if s.kind == kUnknownKey {
			require.Nil(t, row, "a request without a valid key writes no ledger row")
			continue
		}
		require.NotNil(t, row, "no spend row for %s request %s", s.kind, s.id)
		require.Equal(t, int32(s.status), row.status, "%s %s", s.kind, s.id)
		require.Equal(t, s.code, row.code, "%s %s", s.kind, s.id)
		require.Equal(t, s.customer, row.customer, "%s %s", s.kind, s.id)
		switch s.kind {
		case kBlockedKey:
			require.Equal(t, r.org, row.org)
			require.NotEqual(t, r.keyID, row.key)
		default:
			require.Equal(t, r.org, row.org)
			require.Equal(t, r.team, row.team)
			require.Equal(t, r.user, row.user)
			require.Equal(t, r.keyID, row.key)
			require.Equal(t, []string{"ledger", "e2e"}, row.tags)
			require.Equal(t, "agent-ledger", row.agent)
			require.NotEmpty(t, row.session)
		}
		switch s.kind {
		case kChat, kStreamUsage, kCompletion, kEmbedding:
			// Tokens are the usage the client received from the upstream.
			require.Equal(t, r.fastDep, row.dep)
			require.Equal(t, "qwen", row.group)
			require.Equal(t, s.usage.PromptTokens, row.prompt, "%s %s", s.kind, s.id)
			require.Equal(t, s.usage.CompletionTokens, row.completion, "%s %s", s.kind, s.id)
			require.Equal(t, s.usage.cached(), row.cached, "%s %s", s.kind, s.id)
			require.InDelta(t, priceOf(fastPrices, row.prompt, row.cached, row.completion), row.cost, 1e-12, s.id)
		case kStreamPlain:
			require.Equal(t, r.fastDep, row.dep)
			require.Positive(t, row.prompt)
			require.GreaterOrEqual(t, row.completion, s.textChunks, "every relayed text chunk is a token")
			require.InDelta(t, priceOf(fastPrices, row.prompt, row.cached, row.completion), row.cost, 1e-12, s.id)
		case kCancelled:
			// Charged what was relayed: at least what the client read, at
			// most what the engine could generate.
			require.Equal(t, r.slowDep, row.dep)
			require.True(t, row.stream)
			require.GreaterOrEqual(t, row.completion, s.textChunks, s.id)
			require.Less(t, row.completion, int64(cancelMaxTokens), s.id)
			require.Positive(t, row.prompt)
			require.InDelta(t, priceOf(slowPrices, row.prompt, row.cached, row.completion), row.cost, 1e-12, s.id)
			cancelledPrompt += row.prompt
			cancelledCompletion += row.completion
		default: // refusals: never forwarded, nothing charged
			require.Empty(t, row.dep, s.kind)
			require.Zero(t, row.prompt+row.completion+row.cached, s.kind)
			require.Zero(t, row.cost, s.kind)
		}
		if row.dep == r.fastDep {
			fastPrompt += row.prompt
			fastCompletion += row.completion
		}
		if row.cached > 0 {
			cachedRows++
		}
	}
	for _, m := range roundMix {
		require.Equal(t, 3*m.n, kinds[m.kind], m.kind)
	}
	require.Positive(t, cachedRows, "the shared system prompt hit the prefix cache (cached tokens priced)")

	// The engines' own counters: every token the fast engine generated or
	// read is in the ledger exactly once; the cancelled streams were
	// aborted in the slow engine and charged no more than it generated.
	fs := r.fast.Stats()
	require.Equal(t, int64(fs.GenerationTokens), fastCompletion, "completion tokens = the engine's generation_tokens_total")
	require.Equal(t, int64(fs.PromptTokens), fastPrompt, "prompt tokens = the engine's prompt_tokens_total")
	harness.Eventually(t, func() bool { return r.slow.Stats().FinishedAbort == uint64(kinds[kCancelled]) }, 5*time.Second, 10*time.Millisecond,
		"every cancelled stream was aborted upstream")
	ss := r.slow.Stats()
	require.Zero(t, ss.FinishedStop+ss.FinishedLength, "no cancelled stream ran to its end")
	require.LessOrEqual(t, cancelledCompletion, int64(ss.GenerationTokens), "cancelled streams are charged no more than the engine generated")

	// spend_daily = the sums of spend_logs, per scope.
	want, got := expectedDaily(rows), d.spendDaily(t)
	require.Len(t, got, len(want))
	for k, w := range want {
		g := got[k]
		require.NotNil(t, g, "no spend_daily row %+v", k)
		require.Equal(t, [4]int64{w.requests, w.prompt, w.completion, w.cached}, [4]int64{g.requests, g.prompt, g.completion, g.cached}, "%+v", k)
		require.InDelta(t, w.cost, g.cost, 1e-9, "%+v", k)
	}
	// And through SpendService.
	for _, sc := range []struct {
		scope adminv1.SpendScope
		id    string
	}{
		{adminv1.SpendScope_SPEND_SCOPE_ORG, r.org}, {adminv1.SpendScope_SPEND_SCOPE_TEAM, r.team},
		{adminv1.SpendScope_SPEND_SCOPE_KEY, r.keyID}, {adminv1.SpendScope_SPEND_SCOPE_MODEL_GROUP, "qwen"},
		{adminv1.SpendScope_SPEND_SCOPE_MODEL_GROUP, "slow"}, {adminv1.SpendScope_SPEND_SCOPE_CUSTOMER, "cust-1"},
		{adminv1.SpendScope_SPEND_SCOPE_TAG, "e2e"},
	} {
		var w dailySums
		for k, v := range want {
			if k.scope == strings.TrimPrefix(strings.ToLower(sc.scope.String()), "spend_scope_") && k.id == sc.id {
				w.requests += v.requests
				w.prompt += v.prompt
				w.completion += v.completion
				w.cached += v.cached
				w.cost += v.cost
			}
		}
		require.Positive(t, w.requests, sc.scope.String())
		g, err := d.spendClient().GetSpend(context.Background(), connect.NewRequest(&adminv1.GetSpendRequest{Scope: sc.scope, Id: sc.id, OrgId: r.org}))
		require.NoError(t, err)
		require.Equal(t, w.requests, g.Msg.Requests, sc.scope.String())
		require.Equal(t, w.prompt, g.Msg.PromptTokens, sc.scope.String())
		require.Equal(t, w.completion, g.Msg.CompletionTokens, sc.scope.String())
		require.Equal(t, w.cached, g.Msg.CachedTokens, sc.scope.String())
		require.InDelta(t, w.cost, g.Msg.SpendUsd, 1e-9, sc.scope.String())
	}
	var total float64
	for _, row := range rows {
		total += row.cost
	}
	t.Logf("%d requests (%v); %d spend rows; %d with cached tokens; fast engine %d prompt / %d generated tokens; "+
		"cancelled streams charged %d completion tokens of %d the slow engine generated and %d estimated prompt tokens of %d it read; total cost $%.6f",
		len(all), kinds, len(rows), cachedRows, fs.PromptTokens, fs.GenerationTokens, cancelledCompletion, ss.GenerationTokens,
		cancelledPrompt, ss.PromptTokens,
		math.Round(total*1e6)/1e6)
}

// TestCustomerBlockThroughTheProxy: BlockCustomer through the admin API
// makes requests naming that end customer (x-sluice-end-user) 403
// customer_blocked within 1 s; other customers, requests without the
// header and another org's customer of the same external id are served;
// UnblockCustomer restores the customer within 1 s.
func TestCustomerBlockThroughTheProxy(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	sim := startSim(t)
	ctx := context.Background()
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "qwen", PlatformWide: true}))
	require.NoError(t, err)
	_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: "qwen", ApiBase: sim.URL() + "/v1",
		UpstreamModel: vllmsim.DefaultModel, Weight: 1, Prices: fastPrices}))
	require.NoError(t, err)
	acme, other := d.NewTenant("acme"), d.NewTenant("other")
	cc := d.customerClient()
	var custID string
	for _, ten := range []tenant{acme, other} {
		cu, err := cc.CreateCustomer(ctx, connect.NewRequest(&adminv1.CreateCustomerRequest{OrgId: ten.OrgID, ExternalId: "end-user-7"}))
		require.NoError(t, err)
		if ten == acme {
			custID = cu.Msg.Customer.Id
		}
	}
	p := d.StartProxy("default", time.Minute)
	harness.Eventually(t, func() bool {
		cat := p.DP.Catalog()
		return len(cat.Deployments("qwen")) == 1 && cat.Customer(acme.OrgID, "end-user-7") != nil && cat.Customer(other.OrgID, "end-user-7") != nil
	}, 10*time.Second, 10*time.Millisecond)

	body := `{"model":"qwen","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`
	var acmeRequests, acmeRefused int
	ask := func(tok, customer string) openAIError {
		t.Helper()
		if tok == acme.Token {
			acmeRequests++
		}
		req, err := http.NewRequest(http.MethodPost, p.URL+"/v1/chat/completions", strings.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+tok)
		if customer != "" {
			req.Header.Set(dataplane.HeaderEndUser, customer)
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		out := openAIError{status: resp.StatusCode, id: resp.Header.Get(dataplane.RequestIDHeader)}
		require.NoError(t, json.Unmarshal(b, &out), "%s", b)
		if out.Error.Code == dataplane.CodeCustomerBlocked {
			acmeRefused++
		}
		return out
	}
	// until polls until ask answers want and returns how long it took.
	until := func(want int, within time.Duration) (time.Duration, openAIError) {
		t.Helper()
		start := time.Now()
		for {
			a := ask(acme.Token, "end-user-7")
			took := time.Since(start)
			require.Less(t, took, within, "answered %d %+v after %s", a.status, a.Error, took)
			if a.status == want {
				return took, a
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	require.Equal(t, http.StatusOK, ask(acme.Token, "end-user-7").status)

	_, err = cc.BlockCustomer(ctx, connect.NewRequest(&adminv1.BlockCustomerRequest{Id: custID}))
	require.NoError(t, err)
	blockedIn, a := until(http.StatusForbidden, time.Second)
	require.Equal(t, "permission_error", a.Error.Type)
	require.Equal(t, "customer_blocked", a.Error.Code)
	require.Equal(t, dataplane.HeaderEndUser, deref(a.Error.Param))
	require.Equal(t, http.StatusOK, ask(acme.Token, "").status, "no end customer named")
	require.Equal(t, http.StatusOK, ask(acme.Token, "end-user-8").status, "another customer")
	require.Equal(t, http.StatusOK, ask(other.Token, "end-user-7").status, "the same external id in another org")

	_, err = cc.UnblockCustomer(ctx, connect.NewRequest(&adminv1.UnblockCustomerRequest{Id: custID}))
	require.NoError(t, err)
	unblockedIn, _ := until(http.StatusOK, time.Second)
	t.Logf("customer block enforced %s after BlockCustomer returned, lifted %s after UnblockCustomer", blockedIn, unblockedIn)

	// Every request of the org is in the ledger, the refusals with the
	// customer's external id and no cost.
	logs := d.waitLedger(acme.OrgID, acmeRequests, 30*time.Second)
	var refused int
	for _, l := range logs {
		if l.ErrorCode == dataplane.CodeCustomerBlocked {
			refused++
			require.Equal(t, "end-user-7", l.Customer)
			require.Equal(t, int32(http.StatusForbidden), l.Status)
			require.Zero(t, l.CostUsd)
			require.Empty(t, l.DeploymentId)
		}
	}
	require.Positive(t, refused)
	require.Equal(t, acmeRefused, refused)
}
