package gateway

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/dataplane/internal/redispipe"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
)

// cutRelay relays TCP connections to Redis until cut: then it drops every
// connection and closes new ones at once, as if the proxy behind it had
// lost Redis, until restored.
type cutRelay struct {
	ln    net.Listener
	down  atomic.Bool
	mu    sync.Mutex
	conns []net.Conn
}

func startCutRelay(t *testing.T) *cutRelay {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	r := &cutRelay{ln: ln}
	t.Cleanup(func() { _ = ln.Close(); r.cut() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if r.down.Load() {
				_ = c.Close()
				continue
			}
			up, err := net.Dial("tcp", redisAddr)
			if err != nil {
				_ = c.Close()
				continue
			}
			r.mu.Lock()
			r.conns = append(r.conns, c, up)
			r.mu.Unlock()
			go func() { _, _ = io.Copy(up, c); _ = up.Close() }()
			go func() { _, _ = io.Copy(c, up); _ = c.Close() }()
		}
	}()
	return r
}

func (r *cutRelay) cut() {
	r.down.Store(true)
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, c := range r.conns {
		_ = c.Close()
	}
	r.conns = nil
}

// TestLostProxyIsSweptWithItsLastReport: proxy A streams a budgeted,
// tpm- and concurrency-limited request and loses Redis (its renewals stop,
// as if it had died); proxy B's sweeper settles the request once its lease
// expired, with A's last report (tokens ≥ the chunks the client had
// received, the rest of the reservation back in the budget), and records
// its usage event with error code proxy_lost. A, back, finds the request
// swept: its own settlement is a no-op.
func TestLostProxyIsSweptWithItsLastReport(t *testing.T) {
	const ttl = 2 * time.Second
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr, ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { _ = rdb.Close() })
	require.NoError(t, rdb.Ping(context.Background()).Err(), "Redis must run on %s", redisAddr)
	var b [6]byte
	_, _ = rand.Read(b[:])
	prefix := "pt" + hex.EncodeToString(b[:]) + ":"
	t.Cleanup(func() { delPrefix(rdb, prefix) })
	newLim := func(addr string) *limits.Limiter {
		pipe, err := redispipe.New(redispipe.Options{Addr: addr, DialTimeout: 100 * time.Millisecond})
		require.NoError(t, err)
		t.Cleanup(func() { _ = pipe.Close() })
		// The ledger holds nothing yet: the team's budget window is seeded
		// at zero on first use.
		lim, err := limits.New(limits.Config{Pipe: pipe, KeyPrefix: prefix, CallTimeout: 200 * time.Millisecond,
			LeaseTTL: ttl, RenewInterval: 200 * time.Millisecond,
			Seeds: func(_ context.Context, _ string, needs []limits.SeedNeed) ([]int64, error) {
				return make([]int64, len(needs)), nil
			}})
		require.NoError(t, err)
		return lim
	}
	relay := startCutRelay(t)
	limA, limB := newLim(relay.ln.Addr().String()), newLim(redisAddr)
	require.NoError(t, limB.Bootstrap(context.Background(), "o1"))

	a := newEnv(t, func(c *Config) { c.Limiter = limA })
	up := &slowUpstream{n: 100_000, interval: 20 * time.Millisecond}
	a.group("m")
	a.deploy("d1", "m", startUpstream(t, up), nil)
	a.snap.Teams[0].Limits = &configv1.Limits{TpmLimit: ptr[int64](1_000_000), MaxParallelRequests: ptr[int64](10),
		MaxBudget: ptr(100.0), BudgetDuration: "1d"}
	tok := a.key("k1", nil)
	a.apply()
	sinkB := &recSink{}
	regB := prometheus.NewRegistry()
	hB, err := New(Config{Catalog: a.cat.Load, Peppers: a.peppers, Usage: sinkB, Registerer: regB, Region: "test",
		InstanceID: "i2", Logger: slog.New(slog.DiscardHandler), Limiter: limB, NoStreamProbation: true})
	require.NoError(t, err)
	ctx, stop := context.WithCancel(context.Background())
	swDone := make(chan struct{})
	go func() { defer close(swDone); _ = hB.RunSweeper(ctx) }()
	t.Cleanup(func() { stop(); <-swDone })

	spend := func() int64 {
		v, err := rdb.HGet(context.Background(), prefix+"{o:o1}:lim:team:t1", "bs").Int64()
		require.NoError(t, err)
		return v
	}
	resp := a.post(RouteChat, tok, streamBody(5000))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	id := resp.Header.Get(openai.RequestIDHeader)
	var chunks atomic.Int64
	readDone := make(chan struct{})
	go func() {
		defer close(readDone)
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			if strings.Contains(sc.Text(), `"content":"t`) {
				chunks.Add(1)
			}
		}
	}()
	t.Cleanup(func() { resp.Body.Close(); <-readDone })
	reserved := spend()
	require.Greater(t, reserved, int64(5000*2), "the budget holds the reservation (5000 output tokens at $2e-6)")
	// Streams for a while, renewing (and reporting) every 200 ms.
	waitFor(t, "50 chunks", func() bool { return chunks.Load() >= 50 })
	time.Sleep(300 * time.Millisecond)

	relay.cut()
	cutAt := time.Now()
	relayed := chunks.Load()
	require.Empty(t, sinkB.events())
	var ev *usagev1.UsageEvent
	waitFor(t, "the sweep's usage event", func() bool {
		if evs := sinkB.events(); len(evs) > 0 {
			ev = evs[0]
			return true
		}
		return false
	})
	took := time.Since(cutAt)
	t.Logf("swept %s after the cut (lease TTL %s): %d completion tokens reported, %d chunks relayed at the cut", took.Round(time.Millisecond), ttl, ev.CompletionTokens, relayed)
	require.GreaterOrEqual(t, took, ttl-400*time.Millisecond, "swept before the lease expired")
	require.Equal(t, id, ev.RequestId)
	require.Equal(t, openai.CodeProxyLost, ev.ErrorCode)
	require.EqualValues(t, http.StatusOK, ev.Status)
	require.Equal(t, "i1", ev.InstanceId, "the event names the proxy that served the request")
	require.Equal(t, "k1", ev.KeyId)
	require.Equal(t, "t1", ev.TeamId)
	require.Equal(t, "d1", ev.DeploymentId)
	require.True(t, ev.Stream)
	require.GreaterOrEqual(t, ev.CompletionTokens, relayed, "the ledger gets at least what the client received")
	require.Less(t, ev.CompletionTokens, int64(5000), "the report is a bound, not the reservation")
	wantCost := cost(&configv1.Prices{InputPerToken: 1e-6, OutputPerToken: 2e-6}, ev.PromptTokens, 0, ev.CompletionTokens)
	require.InDelta(t, wantCost, ev.CostUsd, 1e-12)
	// The reservation is replaced by the report.
	require.Equal(t, int64(float64(wantCost)*1e6+0.5), spend())
	require.Less(t, spend(), reserved)
	require.Equal(t, 1.0, counterValue(hB.sm.swept.WithLabelValues("published")))
	n, err := rdb.ZCard(context.Background(), prefix+"{o:o1}:par:team:t1").Result()
	require.NoError(t, err)
	require.Zero(t, n, "the lease is gone")
	n, err = rdb.Exists(context.Background(), prefix+"{o:o1}:leases").Result()
	require.NoError(t, err)
	require.Zero(t, n, "the lease index is empty")

	// A was only cut off: it aborted the stream, and once back its
	// settlement finds the request swept and changes nothing.
	<-readDone
	own := a.sink.byID(t, id)
	require.Equal(t, openai.CodeLimitsUnavailable, own.ErrorCode)
	relay.down.Store(false)
	dctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, a.h.Drain(dctx))
	require.Equal(t, 1.0, counterValue(a.h.sm.foundSwept.WithLabelValues("settle")))
	require.Equal(t, int64(float64(wantCost)*1e6+0.5), spend(), "the late settlement did not charge again")
	rec, err := rdb.Get(context.Background(), prefix+"{o:o1}:req:"+id).Result()
	require.NoError(t, err)
	require.Equal(t, "swept", rec)
}

// TestReportsCoverTheRelayedChunks: while a sweepable stream runs, the
// report in its record always covers the chunks the client has received
// (its headroom follows the stream's rate), and its event decodes.
func TestReportsCoverTheRelayedChunks(t *testing.T) {
	le := newLimitsEnv(t)
	up := &slowUpstream{n: 150, interval: 10 * time.Millisecond}
	tok := le.limitedKey(startUpstream(t, up))
	resp := le.post(RouteChat, tok, streamBody(4000))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	id := resp.Header.Get(openai.RequestIDHeader)
	key := le.prefix + "{o:o1}:req:" + id
	sc := bufio.NewScanner(resp.Body)
	var got int64
	checks := 0
	for sc.Scan() {
		if !strings.Contains(sc.Text(), `"content":"t`) {
			continue
		}
		got++
		if got%10 != 0 {
			continue
		}
		// Give an in-flight kick its round trip, then read the report.
		time.Sleep(5 * time.Millisecond)
		raw, err := le.rdb.Get(context.Background(), key).Result()
		require.NoError(t, err)
		if raw == "done" {
			// The proxy relayed the whole stream and settled while this
			// client was still reading buffered chunks (the last chunk, or
			// a client lagging on a loaded machine): nothing left to check.
			break
		}
		head, rest, ok := strings.Cut(raw, "\n")
		require.True(t, ok, "record %q has a report", head)
		usage, _, _ := strings.Cut(rest, "\n")
		tokens, err := strconv.ParseInt(strings.Fields(usage)[0], 10, 64)
		require.NoError(t, err)
		// The event is the tail after the spec; decode the last line that
		// parses (the event may contain newlines itself).
		var ev usagev1.UsageEvent
		decoded := false
		for j := strings.Index(rest, "\n"); j >= 0 && !decoded; {
			k := strings.Index(rest[j+1:], "\n")
			if k < 0 {
				break
			}
			j += 1 + k
			decoded = proto.Unmarshal([]byte(rest[j+1:]), &ev) == nil && ev.RequestId == id
		}
		require.True(t, decoded, "the report's event decodes")
		require.GreaterOrEqual(t, ev.CompletionTokens, got, "report after %d chunks", got)
		require.Equal(t, ev.PromptTokens+ev.CompletionTokens, tokens)
		checks++
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.GreaterOrEqual(t, checks, 5)
	le.drained()
}

func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return -1
	}
	return m.GetCounter().GetValue()
}

func streamBody(maxTokens int) string {
	return `{"model":"m","stream":true,"max_tokens":` + strconv.Itoa(maxTokens) + `,"messages":[{"role":"user","content":"Count."}]}`
}

// BenchmarkReport measures building one report (the usage event of a chat
// stream, marshaled): what each sweepable admission and renewal adds to
// the proxy's CPU.
func BenchmarkReport(b *testing.B) {
	e := newEnv(b)
	// A request of model "qwen", streamed, with a prompt estimate of 120
	// tokens (480 bytes of prompt).
	req, pe := openai.ParseRequest([]byte(`{"model":"qwen","stream":true,"prompt":"` + strings.Repeat("x", 478) + `"}`))
	require.Nil(b, pe)
	require.Equal(b, int64(120), req.PromptEstimate())
	x := &exchange{h: e.h, id: "req_0123456789abcdef01234567", route: RouteChat, start: time.Now(), group: "qwen-30b",
		customer: "customer-42", session: "session-1",
		req: req,
		p: &catalog.Principal{Key: &configv1.Key{Id: "key_0123456789abcdef", OrgId: "org_0123456789abcdef",
			TeamId: "team_0123456789abcdef", UserId: "user_0123456789abcdef", Project: "proj", Tags: []string{"a", "b"}}},
		estTokens: 4200}
	x.dep = &catalog.Deployment{Deployment: &configv1.Deployment{Id: "dep_0123456789abcdef",
		Prices: &configv1.Prices{InputPerToken: 1e-6, OutputPerToken: 2e-6}}}
	x.attempts = 1
	x.progressAttempt()
	x.progressAnswer(true)
	size := 0
	for b.Loop() {
		x.prog.chunks.Add(3)
		size = len(x.report(time.Now()).Event)
	}
	b.ReportMetric(float64(size), "event_bytes")
}
