package system

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sluicegw/sluice/e2e/harness"

	"github.com/sluicegw/sluice/dataplane"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// The load must-shows of issue 5 (limits), through the whole system: the
// control plane's admin API sets the limits, four in-process data planes
// share the machine's Redis (a key prefix of the test's own), and a fake
// upstream counts what reaches it. docs/limits.md states the bounds these
// tests hold the system to.

// lloadClient is an HTTP client for many concurrent requests to a few
// proxies.
func lloadClient(t testing.TB) *http.Client {
	tr := &http.Transport{MaxIdleConns: 2048, MaxIdleConnsPerHost: 512, DisableCompression: true, IdleConnTimeout: 30 * time.Second}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

// lloadAnswer is what a client saw.
type lloadAnswer struct {
	status int
	id     string
	hdr    http.Header
	body   []byte
	err    error
}

func (a lloadAnswer) code() string {
	var e struct {
		Error struct {
			Code, Type, Message string
		} `json:"error"`
	}
	_ = json.Unmarshal(a.body, &e)
	return e.Error.Code
}

func lloadPost(ctx context.Context, c *http.Client, url, tok, body string) lloadAnswer {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		return lloadAnswer{err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+tok)
	resp, err := c.Do(req)
	if err != nil {
		return lloadAnswer{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return lloadAnswer{status: resp.StatusCode, id: resp.Header.Get(dataplane.RequestIDHeader), hdr: resp.Header, body: b, err: err}
}

// lloadDeployment creates a model group with one deployment at upstream.
func lloadDeployment(t testing.TB, d *dist, group, upstream string, prices *adminv1.Prices) {
	t.Helper()
	ctx := context.Background()
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: group, PlatformWide: true}))
	require.NoError(t, err)
	_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: group,
		ApiBase: upstream + "/v1", UpstreamModel: group + "-upstream", Weight: 1, Prices: prices}))
	require.NoError(t, err)
}

// lloadKey creates a key of ten's team (and user) with limits and returns
// its id and token.
func lloadKey(t testing.TB, d *dist, ten tenant, l *adminv1.Limits) (string, string) {
	t.Helper()
	k, err := d.Clients().Key.CreateKey(context.Background(), connect.NewRequest(&adminv1.CreateKeyRequest{
		OrgId: ten.OrgID, TeamId: ten.TeamID, UserId: ten.UserID, Limits: l}))
	require.NoError(t, err)
	return k.Msg.Key.Id, k.Msg.Token
}

// lloadProxies starts n data planes (production limits settings: 50 ms
// call timeout, 30 s lease TTL) and waits until each has every change made
// so far.
//
// Under -race, with four data planes, the control plane, NATS and many
// client goroutines on two shared cores, a limits call sometimes waits
// longer than 50 ms for a CPU; the proxy then fails closed with 503
// limits_unavailable and cancels the admission (settles it with zero
// usage, docs/limits.md). These tests count and report such answers: they
// are the failure policy at work, not what the tests are about, and the
// cancellation keeps them from holding slots or budget.
func lloadProxies(t testing.TB, d *dist, n int) []*proxy {
	t.Helper()
	ps := make([]*proxy, n)
	for i := range ps {
		ps[i] = d.StartProxy("default", time.Minute)
	}
	d.waitCaughtUp(t, 15*time.Second, ps...)
	return ps
}

// lloadWarm sends body with tok to every proxy until it is admitted: an
// org's limits state is new to Redis, so its parallel-limited scopes wait
// out the epoch quarantine first (docs/limits.md).
func lloadWarm(t testing.TB, c *http.Client, ps []*proxy, tok, body string) {
	t.Helper()
	for _, p := range ps {
		var a lloadAnswer
		ok := harness.Until(func() bool {
			a = lloadPost(context.Background(), c, p.URL, tok, body)
			require.NoError(t, a.err)
			return a.status == http.StatusOK
		}, 15*time.Second, 50*time.Millisecond)
		require.True(t, ok, "never admitted: %d %s", a.status, a.body)
	}
}

// lloadDrain waits for every proxy's pending settlements.
func lloadDrain(t testing.TB, ps []*proxy) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, p := range ps {
		require.NoError(t, p.DP.Drain(ctx))
	}
}

// lloadLiveLeases counts unexpired concurrency leases under the test's
// Redis prefix.
func lloadLiveLeases(t testing.TB, d *dist) int64 {
	t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: testRedisAddr})
	defer rdb.Close()
	ctx := context.Background()
	var n int64
	iter := rdb.Scan(ctx, 0, d.RedisPrefix+"*:par:*", 1000).Iterator()
	for iter.Next(ctx) {
		c, err := rdb.ZCount(ctx, iter.Val(), strconv.FormatInt(time.Now().UnixMilli(), 10), "+inf").Result()
		require.NoError(t, err)
		n += c
	}
	require.NoError(t, iter.Err())
	return n
}

// lloadGauge is an in-flight count with its exact history.
type lloadGauge struct {
	mu   sync.Mutex
	cur  int
	peak int
	ev   []lloadEvent
}

type lloadEvent struct {
	at  time.Time
	cur int // in flight from at on
}

func (g *lloadGauge) add(d int) {
	g.mu.Lock()
	g.cur += d
	g.peak = max(g.peak, g.cur)
	g.ev = append(g.ev, lloadEvent{at: time.Now(), cur: g.cur})
	g.mu.Unlock()
}

// mean is the time-weighted mean in-flight count over [a, b).
func (g *lloadGauge) mean(a, b time.Time) float64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	cur, at := 0, a
	var area float64
	for _, e := range g.ev {
		if !e.at.After(a) {
			cur = e.cur
			continue
		}
		if !e.at.Before(b) {
			break
		}
		area += float64(cur) * e.at.Sub(at).Seconds()
		cur, at = e.cur, e.at
	}
	area += float64(cur) * b.Sub(at).Seconds()
	return area / b.Sub(a).Seconds()
}

// lloadStreams is a fake upstream for the concurrency test: a chat
// request whose message reads "team=<id> dur=<ms>" gets an SSE stream of
// that length (a chunk every 100 ms, then usage and [DONE]); in-flight
// requests are counted per team, from arrival until the handler returns.
type lloadStreams struct {
	mu    sync.Mutex
	teams map[string]*lloadGauge
}

func (u *lloadStreams) gauge(team string) *lloadGauge {
	u.mu.Lock()
	defer u.mu.Unlock()
	g := u.teams[team]
	if g == nil {
		g = &lloadGauge{}
		u.teams[team] = g
	}
	return g
}

func (u *lloadStreams) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Messages []struct {
			Content string `json:"content"`
		} `json:"messages"`
	}
	b, _ := io.ReadAll(r.Body)
	if json.Unmarshal(b, &req) != nil || len(req.Messages) == 0 {
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	}
	var team string
	var dur time.Duration
	for f := range strings.FieldsSeq(req.Messages[0].Content) {
		if v, ok := strings.CutPrefix(f, "team="); ok {
			team = v
		}
		if v, ok := strings.CutPrefix(f, "dur="); ok {
			ms, _ := strconv.Atoi(v)
			dur = time.Duration(ms) * time.Millisecond
		}
	}
	g := u.gauge(team)
	g.add(1)
	defer g.add(-1)
	w.Header().Set("Content-Type", "text/event-stream")
	fl := w.(http.Flusher)
	end := time.Now().Add(dur)
	n := 0
	for {
		fmt.Fprintf(w, `data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":"t%d "},"finish_reason":null}]}`+"\n\n", n)
		fl.Flush()
		n++
		left := time.Until(end)
		if left <= 0 {
			break
		}
		select {
		case <-time.After(min(100*time.Millisecond, left)):
		case <-r.Context().Done():
			return
		}
	}
	fmt.Fprintf(w, `data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[],"usage":{"prompt_tokens":10,"completion_tokens":%d,"total_tokens":%d}}`+"\n\ndata: [DONE]\n\n", n, 10+n)
	fl.Flush()
}

// TestLimitsTeamConcurrencyAcrossProxies is issue 5's concurrency
// must-show: a team with max_parallel_requests = 50 (set through the admin
// API), eight keys of the team spread over four data planes, streams of
// 0.5–3 s (uniform), offered open-loop at ~1k req/s for 12 s. The upstream
// never sees more than 50 of the team in flight, and while saturated
// (from 1 s after the start to the end of offering) the time-weighted mean
// in flight is ≥ 95 % of 50. The rate actually offered is measured and
// reported (a -race build on a loaded 2-core machine may offer less than
// asked; the assertions are on peak and utilisation).
func TestLimitsTeamConcurrencyAcrossProxies(t *testing.T) {
	const (
		limit    = 50
		rate     = 1000 // requests per second offered
		offerFor = 12 * time.Second
		warmup   = time.Second // excluded from the utilisation
		nKeys    = 8
		// maxOutstanding bounds the client's goroutines: the 50 streams
		// plus 16 requests being answered. A tick that finds it full skips
		// its request (counted: the rate achieved is reported). Under
		// -race on two cores a refusal costs milliseconds of CPU (proxy,
		// usage event, NATS, control plane, Postgres); with hundreds of
		// them in flight the machine saturates, the data planes under test
		// wait for a CPU between a stream's end and its settlement, and
		// the offered rate falls anyway (measured: 600 outstanding →
		// 635 req/s achieved, 1 s refusal latency, dial timeouts to Redis,
		// 71 % utilisation; 66 outstanding → 620–730 req/s, 98–99 %).
		maxOutstanding = limit + 16
	)
	d := startDist(t)
	up := &lloadStreams{teams: map[string]*lloadGauge{}}
	srv := httptest.NewServer(up)
	t.Cleanup(srv.Close)
	lloadDeployment(t, d, "conc", srv.URL, &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 2e-6})
	ten := d.NewTenant("conc")
	_, err := d.Clients().Team.UpdateTeam(context.Background(), connect.NewRequest(&adminv1.UpdateTeamRequest{
		Team:       &adminv1.Team{Id: ten.TeamID, Limits: &adminv1.Limits{MaxParallelRequests: proto.Int64(limit)}},
		UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"limits.max_parallel_requests"}},
	}))
	require.NoError(t, err)
	toks := []string{ten.Token}
	for len(toks) < nKeys {
		_, tok := lloadKey(t, d, ten, nil)
		toks = append(toks, tok)
	}
	ps := lloadProxies(t, d, 4)
	c := lloadClient(t)
	body := func(dur time.Duration) string {
		return fmt.Sprintf(`{"model":"conc","stream":true,"max_tokens":64,"messages":[{"role":"user","content":"team=%s dur=%d"}]}`,
			ten.TeamID, dur.Milliseconds())
	}
	lloadWarm(t, c, ps, ten.Token, body(10*time.Millisecond))
	lloadDrain(t, ps)
	g := up.gauge(ten.TeamID)
	harness.Eventually(t, func() bool { g.mu.Lock(); defer g.mu.Unlock(); return g.cur == 0 }, 5*time.Second, 10*time.Millisecond)
	g.mu.Lock()
	g.peak, g.ev = 0, nil
	g.mu.Unlock()

	var (
		wg                       sync.WaitGroup
		sent, skipped            atomic.Int64
		mu                       sync.Mutex
		statuses                 = map[string]int{}
		admitted, cut, transport int
		firstErr                 error
		retryAfterMs             []int
	)
	sem := make(chan struct{}, maxOutstanding)
	one := func(i int, dur time.Duration) {
		defer func() { <-sem }()
		sent.Add(1)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		a := lloadPost(ctx, c, ps[i%len(ps)].URL, toks[(i/len(ps))%len(toks)], body(dur))
		mu.Lock()
		defer mu.Unlock()
		if a.err != nil {
			transport++
			if firstErr == nil {
				firstErr = a.err
			}
			return
		}
		statuses[fmt.Sprintf("%d %s", a.status, a.code())]++
		switch a.status {
		case http.StatusOK:
			admitted++
			if !strings.HasSuffix(string(a.body), "data: [DONE]\n\n") {
				cut++
			}
		case http.StatusTooManyRequests:
			if ms, err := strconv.Atoi(a.hdr.Get("Retry-After-Ms")); err == nil {
				retryAfterMs = append(retryAfterMs, ms)
			}
		}
	}
	rng := rand.New(rand.NewPCG(5, 50))
	start := time.Now()
	end := start.Add(offerFor)
	tick := time.NewTicker(time.Millisecond)
	issued := 0
	for now := range tick.C {
		if now.After(end) {
			break
		}
		due := int(rate * now.Sub(start).Seconds())
		for ; issued < due; issued++ {
			dur := 500*time.Millisecond + time.Duration(rng.Int64N(int64(2500*time.Millisecond)))
			select {
			case sem <- struct{}{}:
				i := issued
				wg.Go(func() { one(i, dur) })
			default:
				skipped.Add(1)
			}
		}
	}
	tick.Stop()
	offered := time.Since(start)
	wg.Wait()
	lloadDrain(t, ps)

	satFrom := start.Add(warmup)
	util := g.mean(satFrom, end) / limit
	// The least saturated second, for the report.
	worst := math.Inf(1)
	for s := satFrom; s.Add(time.Second).Compare(end) <= 0; s = s.Add(time.Second) {
		worst = min(worst, g.mean(s, s.Add(time.Second))/limit)
	}
	g.mu.Lock()
	peak, streams := g.peak, len(g.ev)/2
	g.mu.Unlock()
	slices.Sort(retryAfterMs)
	ra := "none"
	if len(retryAfterMs) > 0 {
		ra = fmt.Sprintf("p50 %d ms, max %d ms", retryAfterMs[len(retryAfterMs)/2], retryAfterMs[len(retryAfterMs)-1])
	}
	t.Logf("offered %d requests in %s: %.0f req/s achieved (asked %d; %d skipped with %d client goroutines busy); answers %v; "+
		"%d streams reached the upstream; peak in flight %d (cap %d); utilisation %.2f%% from %s after the start to the end of offering "+
		"(least saturated second %.2f%%); 429 retry-after %s",
		sent.Load(), offered.Round(time.Millisecond), float64(sent.Load())/offered.Seconds(), rate, skipped.Load(), maxOutstanding,
		statuses, streams, peak, limit, 100*util, warmup, 100*worst, ra)
	require.NoError(t, firstErr, "%d transport errors", transport)
	require.LessOrEqual(t, peak, limit, "the upstream saw more than the team's max_parallel_requests in flight")
	require.GreaterOrEqual(t, util, 0.95, "utilisation while saturated")
	require.Zero(t, cut, "admitted streams cut short")
	require.Equal(t, admitted, streams, "every admitted request reached the upstream once")
	for k := range statuses {
		require.Contains(t, []string{"200 ", "429 " + dataplane.CodeConcurrencyLimitExceeded, "503 " + dataplane.CodeLimitsUnavailable}, k, "answers: %v", statuses)
	}
	require.Zero(t, lloadLiveLeases(t, d), "leases left after drain")
}

// lloadFixedUsage is the fake upstream of the rpm/tpm test: it answers
// every chat request at once with fixed usage and records the arrival
// time of each request by kind ("k=<kind>" in the message).
type lloadFixedUsage struct {
	prompt, completion int64
	mu                 sync.Mutex
	arrivals           map[string][]time.Time
}

func (u *lloadFixedUsage) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	at := time.Now()
	b, _ := io.ReadAll(r.Body)
	kind := "?"
	if i := strings.Index(string(b), "k="); i >= 0 {
		kind, _, _ = strings.Cut(string(b[i+2:]), " ")
	}
	u.mu.Lock()
	u.arrivals[kind] = append(u.arrivals[kind], at)
	u.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"id":"x","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],`+
		`"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}`, u.prompt, u.completion, u.prompt+u.completion)
}

// lloadWindows returns the largest sum of w over arrivals (sorted) within
// any window of length win, taking every arrival as a window start and as
// a window end, and the sum within [from, from+win).
func lloadWindows(at []time.Time, w int64, win time.Duration, from time.Time) (worst, first int64) {
	j := 0
	for i := range at { // window [at[i], at[i]+win)
		for j < len(at) && at[j].Before(at[i].Add(win)) {
			j++
		}
		worst = max(worst, int64(j-i)*w)
	}
	i := 0
	for j := range at { // window (at[j]-win, at[j]]
		for !at[i].After(at[j].Add(-win)) {
			i++
		}
		worst = max(worst, int64(j-i+1)*w)
	}
	for _, a := range at {
		if !a.Before(from) && a.Before(from.Add(win)) {
			first += w
		}
	}
	return worst, first
}

// TestLimitsRPMTPMWindows is issue 5's rpm/tpm must-show: a key with
// rpm_limit 300 and a key with tpm_limit 30000, each offered twice its
// limit for 75 s across four data planes. The upstream records when each
// request arrives (and the tpm key's real tokens: fixed usage, below the
// proxy's estimate, so the documented tpm bound adds nothing). In every
// 60 s window the upstream receives at most the limit (docs/limits.md:
// overshoot bound zero), and in the first 60 s at least 95 % of the limit
// is admitted.
//
// Sends are scheduled away from whole seconds (the limiter's 1 s bucket
// edges, Redis TIME on this machine): admissions in buckets k and k+61 are
// then more than 60.1 s apart, so the few milliseconds between an
// admission and its arrival at the upstream cannot bring two of them into
// one 60 s window of arrival times.
func TestLimitsRPMTPMWindows(t *testing.T) {
	t.Parallel()
	const (
		rpm      = 300
		tpm      = 30000
		offerFor = 75 * time.Second
		perSec   = 10 // each key: 600 requests per minute = 2 × its limit
		maxOut   = 50 // max_tokens of every request
		window   = 60 * time.Second
	)
	// The message is 200 bytes of JSON: the proxy's prompt estimate
	// counts 200/4 = 50 tokens, and estimates ⌈4/3 × 50⌉ + 16 + max_tokens
	// (estimate() in internal/proxy/limits.go); the upstream reports the
	// 50 prompt tokens and max_tokens completion tokens.
	msgs := func(kind string) string {
		return fmt.Sprintf(`[{"role":"user","content":"k=%s %s"}]`, kind, strings.Repeat("x", 200-len(`[{"role":"user","content":"k=rpm "}]`)))
	}
	const promptTokens = 200 / 4
	estimate := int64((promptTokens*4+2)/3 + 16 + maxOut)
	real := int64(promptTokens + maxOut)
	require.Len(t, msgs("rpm"), 200)
	require.LessOrEqual(t, real, estimate)

	d := startDist(t)
	up := &lloadFixedUsage{prompt: promptTokens, completion: maxOut, arrivals: map[string][]time.Time{}}
	srv := httptest.NewServer(up)
	t.Cleanup(srv.Close)
	lloadDeployment(t, d, "win", srv.URL, &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 2e-6})
	ten := d.NewTenant("windows")
	rpmKey, rpmTok := lloadKey(t, d, ten, &adminv1.Limits{RpmLimit: proto.Int64(rpm)})
	tpmKey, tpmTok := lloadKey(t, d, ten, &adminv1.Limits{TpmLimit: proto.Int64(tpm)})
	ps := lloadProxies(t, d, 4)
	c := lloadClient(t)
	body := func(kind string) string {
		return fmt.Sprintf(`{"model":"win","max_tokens":%d,"messages":%s}`, maxOut, msgs(kind))
	}

	type tally struct {
		ok, refused, other int
		unavailable        int // 503 limits_unavailable
		codes              map[string]int
		badHeaders         int
	}
	var mu sync.Mutex
	tallies := map[string]*tally{"rpm": {codes: map[string]int{}}, "tpm": {codes: map[string]int{}}}
	var wg sync.WaitGroup
	send := func(kind, tok string, p *proxy) {
		a := lloadPost(context.Background(), c, p.URL, tok, body(kind))
		mu.Lock()
		defer mu.Unlock()
		tl := tallies[kind]
		switch {
		case a.err != nil:
			tl.other++
			tl.codes[a.err.Error()]++
		case a.status == http.StatusOK:
			tl.ok++
		case a.status == http.StatusTooManyRequests:
			tl.refused++
			tl.codes[a.code()]++
			if a.hdr.Get("Retry-After") == "" || a.hdr.Get(dataplane.HeaderLimitType) != kind {
				tl.badHeaders++
			}
		case a.status == http.StatusServiceUnavailable && a.code() == dataplane.CodeLimitsUnavailable:
			tl.unavailable++
		default:
			tl.other++
			tl.codes[fmt.Sprintf("%d %s", a.status, a.code())]++
		}
	}
	// Ten sends per second per key at .075 + k × .085 s past each whole
	// second (k = 0..9): never within 75 ms after or 160 ms before one.
	first := time.Now().Truncate(time.Second).Add(time.Second)
	var offered int
	for s := first; s.Before(first.Add(offerFor)); s = s.Add(time.Second) {
		for k := range perSec {
			at := s.Add(75*time.Millisecond + time.Duration(k)*85*time.Millisecond)
			time.Sleep(time.Until(at))
			p := ps[offered%len(ps)]
			wg.Go(func() { send("rpm", rpmTok, p) })
			wg.Go(func() { send("tpm", tpmTok, p) })
			offered++
		}
	}
	wg.Wait()
	offeredFor := time.Since(first)
	lloadDrain(t, ps)

	up.mu.Lock()
	rpmAt, tpmAt := slices.Clone(up.arrivals["rpm"]), slices.Clone(up.arrivals["tpm"])
	up.mu.Unlock()
	slices.SortFunc(rpmAt, func(a, b time.Time) int { return a.Compare(b) })
	slices.SortFunc(tpmAt, func(a, b time.Time) int { return a.Compare(b) })
	rpmWorst, rpmFirst := lloadWindows(rpmAt, 1, window, first)
	tpmWorst, tpmFirst := lloadWindows(tpmAt, real, window, first)
	t.Logf("offered %d requests per key in %s (%.2f req/s each, 2× the limit); rpm key %s: %d admitted, %d refused %v, %d 503 limits_unavailable, %d other; "+
		"tpm key %s: %d admitted (%d tokens each, estimate %d), %d refused %v, %d 503 limits_unavailable, %d other",
		offered, offeredFor.Round(time.Millisecond), float64(offered)/offeredFor.Seconds(), rpmKey, tallies["rpm"].ok, tallies["rpm"].refused,
		tallies["rpm"].codes, tallies["rpm"].unavailable, tallies["rpm"].other, tpmKey, tallies["tpm"].ok, real, estimate, tallies["tpm"].refused,
		tallies["tpm"].codes, tallies["tpm"].unavailable, tallies["tpm"].other)
	t.Logf("rpm %d: busiest 60 s window at the upstream %d requests; first 60 s %d (%.1f%% of the limit)", rpm, rpmWorst, rpmFirst, 100*float64(rpmFirst)/rpm)
	t.Logf("tpm %d: busiest 60 s window at the upstream %d tokens; first 60 s %d (%.1f%% of the limit)", tpm, tpmWorst, tpmFirst, 100*float64(tpmFirst)/tpm)

	require.Equal(t, tallies["rpm"].ok, len(rpmAt), "rpm key: admitted = arrivals at the upstream")
	require.Equal(t, tallies["tpm"].ok, len(tpmAt), "tpm key: admitted = arrivals at the upstream")
	require.LessOrEqual(t, rpmWorst, int64(rpm), "requests in a 60 s window")
	require.LessOrEqual(t, tpmWorst, int64(tpm), "tokens in a 60 s window (overshoot bound 0: real usage ≤ estimate)")
	require.GreaterOrEqual(t, float64(rpmFirst), 0.95*rpm, "requests admitted in the first 60 s")
	require.GreaterOrEqual(t, float64(tpmFirst), 0.95*tpm, "tokens admitted in the first 60 s")
	require.Equal(t, map[string]int{dataplane.CodeRateLimitExceeded: tallies["rpm"].refused}, tallies["rpm"].codes)
	require.Equal(t, map[string]int{dataplane.CodeTokenRateLimitExceeded: tallies["tpm"].refused}, tallies["tpm"].codes)
	require.Zero(t, tallies["rpm"].badHeaders+tallies["tpm"].badHeaders, "429 without retry-after or with the wrong limit type")
}

// lloadPriced is the fake upstream of the budget test: it answers after
// 20–80 ms with a fixed prompt and a random completion of 1..max_tokens
// tokens, and records the usage it reported per request id.
type lloadPriced struct {
	prompt int64
	maxOut int64
	mu     sync.Mutex
	rng    *rand.Rand
	usage  map[string][2]int64 // request id → prompt, completion
}

func (u *lloadPriced) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/health" {
		// The data planes' active health checks (every 5 s) are not
		// requests: a test slower than that would count one.
		return
	}
	_, _ = io.Copy(io.Discard, r.Body)
	id := r.Header.Get("X-Request-Id")
	u.mu.Lock()
	completion := 1 + u.rng.Int64N(u.maxOut)
	delay := 20*time.Millisecond + time.Duration(u.rng.Int64N(int64(60*time.Millisecond)))
	u.usage[id] = [2]int64{u.prompt, completion}
	u.mu.Unlock()
	time.Sleep(delay)
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"id":"x","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"length"}],`+
		`"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}`, u.prompt, completion, u.prompt+completion)
}

// TestLimitsBudgetUnderConcurrency is issue 5's budget must-show: a team
// with max_budget $0.20 per "1d" window (admin API), four keys, four data
// planes, 40 concurrent clients hammering a priced deployment until every
// request is refused with 429 budget_exceeded. Once the ledger (spend_logs)
// holds every request: the charged spend is at most the cap plus one
// request's maximum cost reservation (docs/limits.md: the in-flight bound
// when real cost ≤ reservation); every row equals the upstream's usage ×
// price; every 429 carries x-should-retry: false and names the team.
func TestLimitsBudgetUnderConcurrency(t *testing.T) {
	const (
		capUSD  = 0.20
		clients = 40
		maxOut  = 200
		inPrice = 2e-6
		outPr   = 4e-6
		// stopAfter consecutive budget refusals end a hammering round.
		stopAfter = 200
	)
	msgs := `[{"role":"user","content":"` + strings.Repeat("y", 170) + `"}]` // 200 bytes
	require.Len(t, msgs, 200)
	const promptTokens = 200 / 4
	// The proxy's reservation (estimate() in internal/proxy/limits.go):
	// prompt ⌈4/3 × 50⌉ + 16 at the input price + max_tokens at the output
	// price, in micro-USD rounded up.
	reserveUSD := float64((promptTokens*4+2)/3+16)*inPrice + maxOut*outPr
	reserveMicros := int64(math.Ceil(reserveUSD * 1e6))
	bound := capUSD + float64(reserveMicros)/1e6

	d := startDist(t)
	up := &lloadPriced{prompt: promptTokens, maxOut: maxOut, rng: rand.New(rand.NewPCG(7, 70)), usage: map[string][2]int64{}}
	srv := httptest.NewServer(up)
	t.Cleanup(srv.Close)
	lloadDeployment(t, d, "priced", srv.URL, &adminv1.Prices{InputPerToken: inPrice, OutputPerToken: outPr})
	ten := d.NewTenant("budget")
	_, err := d.Clients().Team.UpdateTeam(context.Background(), connect.NewRequest(&adminv1.UpdateTeamRequest{
		Team:       &adminv1.Team{Id: ten.TeamID, Limits: &adminv1.Limits{MaxBudget: proto.Float64(capUSD), BudgetDuration: "1d"}},
		UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"limits.max_budget", "limits.budget_duration"}},
	}))
	require.NoError(t, err)
	toks := []string{ten.Token}
	for len(toks) < 4 {
		_, tok := lloadKey(t, d, ten, nil)
		toks = append(toks, tok)
	}
	ps := lloadProxies(t, d, 4)
	c := lloadClient(t)
	body := fmt.Sprintf(`{"model":"priced","max_tokens":%d,"messages":%s}`, maxOut, msgs)
	windowStart := time.Now().UTC()

	var (
		mu       sync.Mutex
		answers  []lloadAnswer
		bad      []string // refusals that break the contract
		admitted = map[string]bool{}
		other    = map[string]int{}
		refusals int
		// unavailable counts 503 limits_unavailable (see lloadProxies).
		unavailable int
	)
	// record keeps an answer and classifies it for the hammering loop.
	const (
		served = iota // admitted, or an unexpected answer
		refused
		unavail
	)
	record := func(a lloadAnswer) int {
		mu.Lock()
		defer mu.Unlock()
		answers = append(answers, a)
		switch {
		case a.err != nil:
			other[a.err.Error()]++
		case a.status == http.StatusOK:
			admitted[a.id] = true
		case a.status == http.StatusTooManyRequests && a.code() == dataplane.CodeBudgetExceeded:
			refusals++
			var e struct {
				Error struct{ Type, Message string } `json:"error"`
			}
			_ = json.Unmarshal(a.body, &e)
			switch {
			case a.hdr.Get("X-Should-Retry") != "false":
				bad = append(bad, "no x-should-retry: false: "+string(a.body))
			case a.hdr.Get(dataplane.HeaderLimitScope) != "team:"+ten.TeamID || a.hdr.Get(dataplane.HeaderLimitType) != "budget":
				bad = append(bad, fmt.Sprintf("scope %q type %q", a.hdr.Get(dataplane.HeaderLimitScope), a.hdr.Get(dataplane.HeaderLimitType)))
			case e.Error.Type != dataplane.TypeBudgetExceeded || !strings.Contains(e.Error.Message, "team "+ten.TeamID):
				bad = append(bad, "error body does not name the team: "+string(a.body))
			case a.hdr.Get("Retry-After") == "":
				bad = append(bad, "no retry-after")
			}
			return refused
		case a.status == http.StatusServiceUnavailable && a.code() == dataplane.CodeLimitsUnavailable:
			unavailable++
			return unavail
		default:
			other[fmt.Sprintf("%d %s", a.status, a.code())]++
		}
		return served
	}
	// hammer runs the clients until stopAfter consecutive answers were
	// budget refusals.
	hammer := func() {
		var streak atomic.Int64
		var wg sync.WaitGroup
		for i := range clients {
			wg.Go(func() {
				tok, p := toks[i%len(toks)], ps[(i/len(toks))%len(ps)]
				for streak.Load() < stopAfter {
					switch record(lloadPost(context.Background(), c, p.URL, tok, body)) {
					case refused:
						streak.Add(1)
					case served:
						streak.Store(0)
					}
				}
			})
		}
		wg.Wait()
	}
	t0 := time.Now()
	rounds := 0
	for {
		rounds++
		hammer()
		lloadDrain(t, ps)
		// Every settlement is in: now every request must be refused, on
		// every data plane and key.
		open := false
		for i, p := range ps {
			got := unavail
			for try := 0; got == unavail && try < 20; try++ {
				got = record(lloadPost(context.Background(), c, p.URL, toks[i], body))
			}
			if got != refused {
				open = true
			}
		}
		if !open {
			break
		}
		require.Less(t, rounds, 5, "requests still admitted after %d hammering rounds", rounds)
		lloadDrain(t, ps)
	}
	hammered := time.Since(t0)
	require.Empty(t, bad, "budget refusals")
	require.Empty(t, other, "answers other than 200, 429 budget_exceeded and 503 limits_unavailable")

	// The ledger holds every request (refusals included, at no cost).
	var rows int
	if !harness.Until(func() bool {
		d.pg(t, func(ctx context.Context, conn *pgx.Conn) {
			require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM spend_logs WHERE org_id = $1`, ten.OrgID).Scan(&rows))
		})
		return rows >= len(answers)
	}, 60*time.Second, 50*time.Millisecond) {
		t.Fatalf("spend_logs has %d of %d requests; spend consumer: %s", rows, len(answers), d.spendConsumerInfo())
	}
	type row struct {
		status             int32
		prompt, completion int64
		cost               float64
	}
	ledger := map[string]row{}
	d.pg(t, func(ctx context.Context, conn *pgx.Conn) {
		rs, err := conn.Query(ctx, `SELECT request_id, status, prompt_tokens, completion_tokens, cost_usd FROM spend_logs WHERE org_id = $1`, ten.OrgID)
		require.NoError(t, err)
		for rs.Next() {
			var id string
			var r row
			require.NoError(t, rs.Scan(&id, &r.status, &r.prompt, &r.completion, &r.cost))
			ledger[id] = r
		}
		require.NoError(t, rs.Err())
	})
	require.Len(t, ledger, len(answers), "one spend_logs row per request")

	up.mu.Lock()
	usage := maps.Clone(up.usage)
	up.mu.Unlock()
	require.Len(t, usage, len(admitted), "requests that reached the upstream = requests admitted")
	var charged, upstreamCost float64
	for _, a := range answers {
		r, ok := ledger[a.id]
		require.True(t, ok, "no spend_logs row for %s", a.id)
		require.Equal(t, int32(a.status), r.status, a.id)
		if a.status != http.StatusOK {
			require.Zero(t, r.cost, "refused request %s charged", a.id)
			continue
		}
		u, ok := usage[a.id]
		require.True(t, ok, "admitted request %s never reached the upstream", a.id)
		want := float64(u[0])*inPrice + float64(u[1])*outPr
		require.Equal(t, u, [2]int64{r.prompt, r.completion}, "tokens of %s: upstream vs ledger", a.id)
		require.InDelta(t, want, r.cost, 1e-12, "cost of %s", a.id)
		require.LessOrEqual(t, want, reserveUSD+1e-12, "real cost of %s within its reservation (the bound's premise)", a.id)
		charged += r.cost
		upstreamCost += want
	}
	require.InDelta(t, upstreamCost, charged, 1e-9, "ledger = upstream usage × price")

	// The Redis counter of the window, for the report: settled real costs
	// in micro-USD (each rounded up).
	rdb := redis.NewClient(&redis.Options{Addr: testRedisAddr})
	defer rdb.Close()
	counter, err := rdb.HGet(context.Background(), d.RedisPrefix+"{o:"+ten.OrgID+"}:lim:team:"+ten.TeamID, "bs").Int64()
	require.NoError(t, err)
	t.Logf("%d clients, %d hammering round(s) in %s: %d requests, %d admitted, %d refused with budget_exceeded (all with x-should-retry: false, "+
		"naming team:%s), %d 503 limits_unavailable; charged $%.6f (spend_logs) = upstream usage × price $%.6f; cap $%.2f, bound cap + one reservation $%.6f "+
		"(reservation $%.6f); overshoot $%.6f = %.2f reservations; Redis window counter $%.6f",
		clients, rounds, hammered.Round(time.Millisecond), len(answers), len(admitted), refusals, ten.TeamID, unavailable, charged, upstreamCost,
		capUSD, bound, float64(reserveMicros)/1e6, charged-capUSD, (charged-capUSD)*1e6/float64(reserveMicros), float64(counter)/1e6)
	if end := windowStart.Truncate(24 * time.Hour).Add(24 * time.Hour); time.Now().After(end) {
		t.Logf("the 1d budget window ended during the test (%s): the cap applies per window", end)
		return
	}
	require.LessOrEqual(t, charged, bound, "charged spend over the cap beyond the in-flight bound")
	// Every request is refused, so the window's counter is at the cap; it
	// holds the settled costs, each rounded up to a micro-USD.
	require.GreaterOrEqual(t, counter, int64(math.Round(capUSD*1e6)), "Redis budget counter below the cap while refusing")
	require.InDelta(t, charged*1e6, float64(counter), float64(len(admitted)+1), "Redis budget counter = ledger (µUSD rounding per request)")
}
