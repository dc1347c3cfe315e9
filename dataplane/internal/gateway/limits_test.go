package gateway

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/dataplane/internal/redisconn"
	"github.com/sluicegw/sluice/dataplane/internal/redispipe"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// redisAddr is the machine's Redis; these tests fail when it is missing.
const redisAddr = "127.0.0.1:6379"

// limitsEnv is a proxy env with a real Redis limiter under a key prefix of
// the test's own.
type limitsEnv struct {
	*env
	// rdb is a *redis.Client, or a *redis.ClusterClient for the tests
	// run on a Redis Cluster (TestRoutingOnCluster).
	rdb redis.UniversalClient
	// cluster is the data plane's Redis Cluster connection (nil: one
	// Redis), which the limiter uses.
	cluster *redisconn.Conn
	prefix  string
	lim     *limits.Limiter
	// seedErr, when set, fails the limiter's budget seed requests; else
	// every budget window is seeded with zero spend (an empty ledger).
	seedErr atomic.Pointer[error]
}

func newLimitsEnv(t *testing.T, opts ...envOpt) *limitsEnv {
	t.Helper()
	var b [6]byte
	_, _ = rand.Read(b[:])
	prefix := "pt" + hex.EncodeToString(b[:]) + ":"
	lc := limits.Config{KeyPrefix: prefix, CallTimeout: 200 * time.Millisecond}
	var rdb redis.UniversalClient
	var conn *redisconn.Conn
	if rc := onCluster(t); rc != nil {
		// The data plane's Cluster connection (redisconn.Open); rdb, a
		// client of its own, for the tests' checks.
		var err error
		conn, err = redisconn.Open("", rc.Addrs)
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close() })
		rdb, lc.Client = rc.Client(t), conn.Cluster
		lc.CallTimeout = time.Second // a Cluster client's first calls load the slot map and dial every node
	} else {
		rdb = redis.NewClient(&redis.Options{Addr: redisAddr, ContextTimeoutEnabled: true, MaxRetries: -1})
		t.Cleanup(func() { _ = rdb.Close() })
		pipe, err := redispipe.New(redispipe.Options{Addr: redisAddr})
		require.NoError(t, err)
		t.Cleanup(func() { _ = pipe.Close() })
		lc.Pipe = pipe
	}
	require.NoError(t, rdb.Ping(context.Background()).Err(), "Redis must run on %s", redisAddr)
	t.Cleanup(func() { delPrefix(rdb, prefix) })
	le := &limitsEnv{rdb: rdb, prefix: prefix, cluster: conn}
	lim, err := limits.New(limits.Config{Pipe: lc.Pipe, Client: lc.Client, KeyPrefix: prefix, CallTimeout: lc.CallTimeout,
		Seeds: func(_ context.Context, _ string, needs []limits.SeedNeed) ([]int64, error) {
			if err := le.seedErr.Load(); err != nil {
				return nil, *err
			}
			return make([]int64, len(needs)), nil
		}})
	require.NoError(t, err)
	le.lim = lim
	// The org and deployment were "created" (as a data plane does on the
	// creation event): no quarantine.
	for _, id := range []string{"o1", limits.DeploymentOrg("d1")} {
		require.NoError(t, lim.Bootstrap(context.Background(), id))
	}
	opts = append([]envOpt{func(c *Config) { c.Limiter = lim }}, opts...)
	le.env = newEnv(t, opts...)
	return le
}

func delPrefix(rdb redis.UniversalClient, prefix string) {
	ctx := context.Background()
	for _, k := range keysOf(rdb, prefix+"*") {
		rdb.Del(ctx, k) // one by one: a Cluster's keys are on several slots
	}
}

// keysOf returns the keys matching pattern, from every master of a
// Cluster.
func keysOf(rdb redis.UniversalClient, pattern string) []string {
	ctx := context.Background()
	if c, ok := rdb.(*redis.ClusterClient); ok {
		var mu sync.Mutex
		var out []string
		_ = c.ForEachMaster(ctx, func(ctx context.Context, n *redis.Client) error {
			keys, err := n.Keys(ctx, pattern).Result()
			mu.Lock()
			out = append(out, keys...)
			mu.Unlock()
			return err
		})
		return out
	}
	keys, _ := rdb.Keys(ctx, pattern).Result()
	return keys
}

// leases counts the live concurrency leases under the env's prefix.
func (le *limitsEnv) leases() int64 {
	ctx := context.Background()
	var n int64
	for _, k := range keysOf(le.rdb, le.prefix+"*:par:*") {
		c, err := le.rdb.ZCount(ctx, k, strconv.FormatInt(time.Now().UnixMilli(), 10), "+inf").Result()
		require.NoError(le.t, err)
		n += c
	}
	return n
}

// drained waits for pending settlements and asserts no lease is left.
func (le *limitsEnv) drained() {
	le.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(le.t, le.h.Drain(ctx))
	require.Zero(le.t, le.leases(), "leases left after drain")
}

// slowUpstream streams one SSE chunk every interval for n chunks, then
// usage and [DONE]; status != 200 answers that status at once; delay
// delays the response headers.
type slowUpstream struct {
	status   int
	delay    time.Duration
	n        int // set with setN once requests run
	nMu      sync.Mutex
	interval time.Duration
	inFlight atomic.Int64
	peak     atomic.Int64
}

func (u *slowUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	cur := u.inFlight.Add(1)
	defer u.inFlight.Add(-1)
	for {
		p := u.peak.Load()
		if cur <= p || u.peak.CompareAndSwap(p, cur) {
			break
		}
	}
	body, _ := io.ReadAll(r.Body)
	u.nMu.Lock()
	n := u.n
	u.nMu.Unlock()
	if u.status != 0 && u.status != 200 {
		http.Error(w, `{"error":{"message":"boom"}}`, u.status)
		return
	}
	select {
	case <-time.After(u.delay):
	case <-r.Context().Done():
		return
	}
	if !strings.Contains(string(body), `"stream":true`) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15}}`)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	fl := w.(http.Flusher)
	for i := 0; i < n; i++ {
		fmt.Fprintf(w, "data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"t%d\"}}]}\n\n", i)
		fl.Flush()
		select {
		case <-time.After(u.interval):
		case <-r.Context().Done():
			return
		}
	}
	fmt.Fprintf(w, "data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":%d,\"total_tokens\":%d}}\n\n", n, 10+n)
	fmt.Fprint(w, "data: [DONE]\n\n")
	fl.Flush()
}

// setN changes the chunks of the streams that start from now on.
func (u *slowUpstream) setN(n int) {
	u.nMu.Lock()
	u.n = n
	u.nMu.Unlock()
}

func startUpstream(t *testing.T, u *slowUpstream) string {
	srv := httptest.NewServer(u)
	t.Cleanup(srv.Close)
	return srv.URL + "/v1"
}

// limitedKey adds model group m, a deployment at base and a key whose team
// carries every kind of limit.
func (le *limitsEnv) limitedKey(base string) string {
	le.group("m")
	le.deploy("d1", "m", base, nil)
	le.snap.Teams[0].Limits = &configv1.Limits{RpmLimit: ptr[int64](1000), TpmLimit: ptr[int64](1_000_000),
		MaxParallelRequests: ptr[int64](10), MaxBudget: ptr(100.0), BudgetDuration: "1d"}
	tok := le.key("k1", nil)
	le.apply()
	return tok
}

func ptr[T any](v T) *T { return &v }

// withIETFHeaders turns the IETF RateLimit fields on
// (--ietf-rate-limit-headers).
func withIETFHeaders(c *Config) { c.IETFRateLimitHeaders = true }

// TestLimitsHeadersOnSuccess: the x-ratelimit-* headers on every limited
// answer; the IETF RateLimit fields only with --ietf-rate-limit-headers.
func TestLimitsHeadersOnSuccess(t *testing.T) {
	for _, ietf := range []bool{false, true} {
		t.Run("ietf="+strconv.FormatBool(ietf), func(t *testing.T) {
			var opts []envOpt
			if ietf {
				opts = append(opts, withIETFHeaders)
			}
			le := newLimitsEnv(t, opts...)
			tok := le.limitedKey(startUpstream(t, &slowUpstream{}))
			resp := le.post(RouteChat, tok, chatBody("m", ""))
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			require.Equal(t, 200, resp.StatusCode)
			require.Equal(t, "1000", resp.Header.Get("X-Ratelimit-Limit-Requests"))
			require.Equal(t, "999", resp.Header.Get("X-Ratelimit-Remaining-Requests"))
			require.NotEmpty(t, resp.Header.Get("X-Ratelimit-Reset-Requests"))
			require.Equal(t, "1000000", resp.Header.Get("X-Ratelimit-Limit-Tokens"))
			rem, err := strconv.ParseInt(resp.Header.Get("X-Ratelimit-Remaining-Tokens"), 10, 64)
			require.NoError(t, err)
			require.Less(t, rem, int64(1_000_000))
			if !ietf {
				require.NotContains(t, resp.Header, "Ratelimit-Policy")
				require.NotContains(t, resp.Header, "Ratelimit")
				le.drained()
				return
			}
			require.Equal(t, `"rpm";q=1000;w=60, "tpm";q=1000000;w=60`, resp.Header.Get("RateLimit-Policy"))
			require.Contains(t, resp.Header.Get("RateLimit"), `"rpm";r=999;t=`)
			le.drained()
		})
	}
}

func TestLimitsHeadersOnStream(t *testing.T) {
	le := newLimitsEnv(t, withIETFHeaders)
	tok := le.limitedKey(startUpstream(t, &slowUpstream{n: 3, interval: 5 * time.Millisecond}))
	resp := le.post(RouteChat, tok, chatBody("m", `"stream":true`))
	data := sseData(t, resp.Body)
	resp.Body.Close()
	require.Equal(t, 200, resp.StatusCode)
	require.Equal(t, "[DONE]", data[len(data)-1])
	require.Equal(t, "1000", resp.Header.Get("X-Ratelimit-Limit-Requests"))
	require.NotEmpty(t, resp.Header.Get("RateLimit"))
	le.drained()
}

func TestLimitsRPMRejection(t *testing.T) {
	le := newLimitsEnv(t)
	le.group("m")
	le.deploy("d1", "m", startUpstream(t, &slowUpstream{}), nil)
	tok := le.key("k1", func(k *configv1.Key) { k.Limits = &configv1.Limits{RpmLimit: ptr[int64](2)} })
	le.apply()
	for range 2 {
		resp := le.post(RouteChat, tok, chatBody("m", ""))
		resp.Body.Close()
		require.Equal(t, 200, resp.StatusCode)
	}
	e := readErr(t, le.post(RouteChat, tok, chatBody("m", "")))
	require.Equal(t, 429, e.Status)
	require.Equal(t, openai.CodeRateLimitExceeded, e.Error.Code)
	require.Equal(t, openai.TypeRateLimit, e.Error.Type)
	require.Equal(t, "key:k1", e.Header.Get(openai.HeaderLimitScope))
	require.Equal(t, "rpm", e.Header.Get(openai.HeaderLimitType))
	require.Equal(t, "0", e.Header.Get("X-Ratelimit-Remaining-Requests"))
	ms, err := strconv.ParseInt(e.Header.Get("Retry-After-Ms"), 10, 64)
	require.NoError(t, err)
	require.Greater(t, ms, int64(55_000), "the oldest request leaves the 60 s window in ~60 s")
	require.LessOrEqual(t, ms, int64(61_000))
	require.Contains(t, e.Error.Message, "key k1")
	le.drained()
}

func TestLimitsConcurrencyRetryAfterIsShort(t *testing.T) {
	le := newLimitsEnv(t)
	up := &slowUpstream{n: 100, interval: 10 * time.Millisecond}
	le.group("m")
	le.deploy("d1", "m", startUpstream(t, up), nil)
	tok := le.key("k1", func(k *configv1.Key) { k.Limits = &configv1.Limits{MaxParallelRequests: ptr[int64](1)} })
	le.apply()
	first := le.post(RouteChat, tok, chatBody("m", `"stream":true`))
	defer first.Body.Close()
	require.Equal(t, 200, first.StatusCode)
	e := readErr(t, le.post(RouteChat, tok, chatBody("m", "")))
	require.Equal(t, 429, e.Status)
	require.Equal(t, openai.CodeConcurrencyLimitExceeded, e.Error.Code)
	require.Equal(t, "parallel", e.Header.Get(openai.HeaderLimitType))
	require.Equal(t, "1", e.Header.Get("Retry-After"), "a concurrency rejection never says 60 s")
	ms, _ := strconv.Atoi(e.Header.Get("Retry-After-Ms"))
	require.LessOrEqual(t, ms, 1000)
	_, _ = io.Copy(io.Discard, first.Body)
	le.drained()
}

func TestLimitsBudgetExceeded(t *testing.T) {
	le := newLimitsEnv(t)
	le.group("m")
	// 10 prompt + 5 completion tokens at $1 and $2 per token: $20 a request.
	le.deploy("d1", "m", startUpstream(t, &slowUpstream{}), func(d *configv1.Deployment) {
		d.Prices = &configv1.Prices{InputPerToken: 1, OutputPerToken: 2}
	})
	tok := le.key("k1", func(k *configv1.Key) {
		k.Limits = &configv1.Limits{MaxBudget: ptr(30.0), BudgetDuration: "1d"}
	})
	le.apply()
	for range 2 { // $0 < $30, then $20 < $30: both admitted; spend is then $40
		resp := le.post(RouteChat, tok, chatBody("m", ""))
		resp.Body.Close()
		require.Equal(t, 200, resp.StatusCode)
		require.NoError(t, le.h.Drain(context.Background()))
	}
	e := readErr(t, le.post(RouteChat, tok, chatBody("m", "")))
	require.Equal(t, 429, e.Status)
	require.Equal(t, openai.CodeBudgetExceeded, e.Error.Code)
	require.Equal(t, openai.TypeBudgetExceeded, e.Error.Type)
	require.Equal(t, "false", e.Header.Get("X-Should-Retry"))
	require.Equal(t, "key:k1", e.Header.Get(openai.HeaderLimitScope))
	require.Equal(t, "budget", e.Header.Get(openai.HeaderLimitType))
	require.Contains(t, e.Error.Message, "spend $40.000000")
	require.Contains(t, e.Error.Message, "cap $30.000000")
	_, end, err := limits.BudgetWindow("1d", time.Now())
	require.NoError(t, err)
	secs, err := strconv.ParseInt(e.Header.Get("Retry-After"), 10, 64)
	require.NoError(t, err)
	require.InDelta(t, time.Until(end).Seconds(), float64(secs), 2, "retry-after runs until the window resets")
	le.drained()
}

func TestLimitsTPMNeverFits(t *testing.T) {
	le := newLimitsEnv(t)
	le.group("m")
	le.deploy("d1", "m", startUpstream(t, &slowUpstream{}), nil)
	tok := le.key("k1", func(k *configv1.Key) { k.Limits = &configv1.Limits{TpmLimit: ptr[int64](50)} })
	le.apply()
	e := readErr(t, le.post(RouteChat, tok, `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1000}`))
	require.Equal(t, 429, e.Status)
	require.Equal(t, openai.CodeTokenRateLimitExceeded, e.Error.Code)
	require.Equal(t, "false", e.Header.Get("X-Should-Retry"))
	require.Contains(t, e.Error.Message, "lower max_tokens")
}

func TestLimitsUnavailableFailsClosed(t *testing.T) {
	// A Redis that accepts connections and never answers (SIGSTOP-like),
	// and one that refuses them.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { _ = c.Close() })
		}
	}()
	dead, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	deadAddr := dead.Addr().String()
	require.NoError(t, dead.Close())
	for _, tc := range []struct{ name, addr string }{{"silent", ln.Addr().String()}, {"refused", deadAddr}} {
		t.Run(tc.name, func(t *testing.T) {
			pipe, err := redispipe.New(redispipe.Options{Addr: tc.addr})
			require.NoError(t, err)
			t.Cleanup(func() { _ = pipe.Close() })
			lim, err := limits.New(limits.Config{Pipe: pipe})
			require.NoError(t, err)
			e := newEnv(t, func(c *Config) {
				c.Limiter = lim
				c.RateFallback = limits.NewLocalLimiter(func() int { return 2 })
				c.RateFallbackDefault = true
			})
			e.group("m")
			e.deploy("d1", "m", startUpstream(t, &slowUpstream{}), nil)
			par := e.key("kp", func(k *configv1.Key) { k.Limits = &configv1.Limits{MaxParallelRequests: ptr[int64](5)} })
			bud := e.key("kb", func(k *configv1.Key) { k.Limits = &configv1.Limits{MaxBudget: ptr(5.0), BudgetDuration: "1d"} })
			rpm := e.key("kr", func(k *configv1.Key) { k.Limits = &configv1.Limits{RpmLimit: ptr[int64](4)} })
			// A level may refuse the fallback the data plane allows.
			closed := e.key("kc", func(k *configv1.Key) {
				k.Limits = &configv1.Limits{RpmLimit: ptr[int64](4), RateLimitFallback: "closed"}
			})
			free := e.key("kf", nil)
			e.apply()
			for _, tok := range []string{par, bud} {
				start := time.Now()
				er := readErr(t, e.post(RouteChat, tok, chatBody("m", "")))
				require.Equal(t, 503, er.Status)
				require.Equal(t, openai.CodeLimitsUnavailable, er.Error.Code)
				require.Less(t, time.Since(start), 150*time.Millisecond)
			}
			// rpm-only: the local share (4 ÷ 2 planes = 2) applies.
			for range 2 {
				resp := e.post(RouteChat, rpm, chatBody("m", ""))
				resp.Body.Close()
				require.Equal(t, 200, resp.StatusCode)
			}
			er := readErr(t, e.post(RouteChat, rpm, chatBody("m", "")))
			require.Equal(t, 429, er.Status)
			er = readErr(t, e.post(RouteChat, closed, chatBody("m", "")))
			require.Equal(t, 503, er.Status)
			require.Equal(t, openai.CodeLimitsUnavailable, er.Error.Code)
			// No limits at all: no Redis call, served.
			resp := e.post(RouteChat, free, chatBody("m", ""))
			resp.Body.Close()
			require.Equal(t, 200, resp.StatusCode)
		})
	}
}

func TestLimitsWithoutLimiterFailClosed(t *testing.T) {
	e := newEnv(t)
	e.group("m")
	e.deploy("d1", "m", startUpstream(t, &slowUpstream{}), nil)
	tok := e.key("k1", func(k *configv1.Key) { k.Limits = &configv1.Limits{RpmLimit: ptr[int64](5)} })
	e.apply()
	er := readErr(t, e.post(RouteChat, tok, chatBody("m", "")))
	require.Equal(t, 503, er.Status)
	require.Equal(t, openai.CodeLimitsUnavailable, er.Error.Code)
}

// Exit paths: every way a request ends releases its lease.

func TestLimitsExitSuccess(t *testing.T) {
	le := newLimitsEnv(t)
	tok := le.limitedKey(startUpstream(t, &slowUpstream{n: 3, interval: time.Millisecond}))
	for _, body := range []string{chatBody("m", ""), chatBody("m", `"stream":true`)} {
		resp := le.post(RouteChat, tok, body)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		require.Equal(t, 200, resp.StatusCode)
	}
	le.drained()
}

func TestLimitsExitUpstream5xx(t *testing.T) {
	le := newLimitsEnv(t)
	tok := le.limitedKey(startUpstream(t, &slowUpstream{status: 500}))
	resp := le.post(RouteChat, tok, chatBody("m", ""))
	resp.Body.Close()
	require.GreaterOrEqual(t, resp.StatusCode, 500)
	le2 := newLimitsEnv(t)
	tok2 := le2.limitedKey(startUpstream(t, &slowUpstream{status: 503}))
	resp = le2.post(RouteChat, tok2, chatBody("m", ""))
	resp.Body.Close()
	require.Equal(t, 503, resp.StatusCode)
	le.drained()
	le2.drained()
}

func TestLimitsExitTimeout(t *testing.T) {
	le := newLimitsEnv(t, func(c *Config) { c.RequestTimeout = 200 * time.Millisecond })
	tok := le.limitedKey(startUpstream(t, &slowUpstream{delay: 5 * time.Second}))
	e := readErr(t, le.post(RouteChat, tok, chatBody("m", "")))
	require.Equal(t, 504, e.Status)
	le.drained()
	// A stream cut by the deadline mid-way.
	le2 := newLimitsEnv(t, func(c *Config) { c.RequestTimeout = 300 * time.Millisecond })
	tok2 := le2.limitedKey(startUpstream(t, &slowUpstream{n: 100, interval: 20 * time.Millisecond}))
	resp := le2.post(RouteChat, tok2, chatBody("m", `"stream":true`))
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	le2.drained()
}

func TestLimitsExitClientCancelMidStream(t *testing.T) {
	le := newLimitsEnv(t)
	up := &slowUpstream{n: 1000, interval: 10 * time.Millisecond}
	tok := le.limitedKey(startUpstream(t, up))
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, le.srv.URL+RouteChat, strings.NewReader(chatBody("m", `"stream":true`)))
	req.Header.Set("Authorization", "Bearer "+tok)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	buf := make([]byte, 64)
	_, err = resp.Body.Read(buf)
	require.NoError(t, err)
	require.EqualValues(t, 1, le.leases(), "the stream holds its lease")
	cancel()
	resp.Body.Close()
	waitFor(t, "the upstream request to end", func() bool { return up.inFlight.Load() == 0 })
	// The exchange finishes (and queues its settlement) after the upstream
	// request ends: its usage event says it has.
	waitFor(t, "the exchange to finish", func() bool { return len(le.sink.events()) == 1 })
	le.drained()
}

// panicTransport panics in RoundTrip: the handler goroutine panics mid
// request.
type panicTransport struct{}

func (panicTransport) RoundTrip(*http.Request) (*http.Response, error) {
	panic("injected handler panic")
}

func TestLimitsExitHandlerPanic(t *testing.T) {
	le := newLimitsEnv(t, func(c *Config) { c.Transport = panicTransport{} })
	le.srv.Config.ErrorLog = nil
	tok := le.limitedKey("http://127.0.0.1:1/v1")
	req, _ := http.NewRequest(http.MethodPost, le.srv.URL+RouteChat, strings.NewReader(chatBody("m", "")))
	req.Header.Set("Authorization", "Bearer "+tok)
	_, err := http.DefaultClient.Do(req)
	require.Error(t, err, "net/http drops the connection of a panicking handler")
	le.drained()
}

func TestLimitsDeploymentMaxConcurrencyFleetWide(t *testing.T) {
	// Two proxies (handlers) share Redis: the deployment's max_concurrency
	// of 2 holds across both, not per instance.
	le := newLimitsEnv(t)
	up := &slowUpstream{n: 50, interval: 10 * time.Millisecond}
	le.group("m")
	le.deploy("d1", "m", startUpstream(t, up), func(d *configv1.Deployment) { d.MaxConcurrency = 2 })
	tok := le.key("k1", nil)
	le.apply()
	other := newEnv(t, func(c *Config) { c.Limiter = le.lim })
	other.snap = le.snap
	other.apply()
	var open []*http.Response
	for _, e := range []*env{le.env, other, le.env} {
		resp := e.post(RouteChat, tok, chatBody("m", `"stream":true`))
		open = append(open, resp)
	}
	codes := []int{open[0].StatusCode, open[1].StatusCode, open[2].StatusCode}
	require.Equal(t, []int{200, 200, 503}, codes)
	er := readErr(t, open[2])
	require.Equal(t, openai.CodeOverloaded, er.Error.Code)
	require.LessOrEqual(t, up.peak.Load(), int64(2))
	for _, r := range open[:2] {
		_, _ = io.Copy(io.Discard, r.Body)
		r.Body.Close()
	}
	require.NoError(t, other.h.Drain(context.Background()))
	le.drained()
}

func TestAttributionHeadersMustBeUTF8(t *testing.T) {
	e := newEnv(t)
	e.group("m")
	e.deploy("d1", "m", startUpstream(t, &slowUpstream{}), nil)
	tok := e.key("k1", nil)
	e.apply()
	er := readErr(t, e.post(RouteChat, tok, chatBody("m", ""), openai.HeaderEndUser, "bad\xffname"))
	require.Equal(t, 400, er.Status)
	require.Equal(t, openai.CodeInvalidHeader, er.Error.Code)
	require.Eventually(t, func() bool { return len(e.sink.events()) >= 1 }, 5*time.Second, 2*time.Millisecond)
	evs := e.sink.events()
	require.Len(t, evs, 1, "the refusal is in the ledger")
	require.Equal(t, "bad\uFFFDname", evs[0].Customer)
	_, err := proto.Marshal(evs[0])
	require.NoError(t, err, "the usage event can be encoded")
}
