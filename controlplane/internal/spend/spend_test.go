package spend

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/testsvc"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// tcpProxy forwards connections to a backend and can cut them all, to
// make Postgres unreachable for a while.
type tcpProxy struct {
	ln      net.Listener
	backend string
	mu      sync.Mutex
	down    bool
	conns   map[net.Conn]bool
}

func startProxy(t *testing.T, backend string) *tcpProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &tcpProxy{ln: ln, backend: backend, conns: map[net.Conn]bool{}}
	t.Cleanup(func() { _ = ln.Close(); p.setDown(true) })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go p.serve(c)
		}
	}()
	return p
}

func (p *tcpProxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.down {
		_ = c.Close()
		return false
	}
	p.conns[c] = true
	return true
}

func (p *tcpProxy) serve(c net.Conn) {
	if !p.track(c) {
		return
	}
	b, err := net.Dial("tcp", p.backend)
	if err != nil || !p.track(b) {
		_ = c.Close()
		return
	}
	go func() { _, _ = io.Copy(b, c); _ = b.Close() }()
	_, _ = io.Copy(c, b)
	_ = c.Close()
}

// setDown cuts every connection and refuses new ones (down) or lets them
// through again.
func (p *tcpProxy) setDown(down bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = down
	if down {
		for c := range p.conns {
			_ = c.Close()
		}
		p.conns = map[net.Conn]bool{}
	}
}

type bundle struct {
	t     *testing.T
	pool  *pgxpool.Pool // direct, for assertions
	dbURL string
	nats  *testsvc.NATSServer
	nc    *nats.Conn
	js    jetstream.JetStream
}

func setup(t *testing.T) *bundle {
	t.Helper()
	pool, dbURL := testsvc.NewPool(t)
	b := &bundle{t: t, pool: pool, dbURL: dbURL, nats: testsvc.StartNATS(t)}
	nc, err := nats.Connect(b.nats.URL, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	b.nc = nc
	b.js, err = jetstream.New(nc)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = b.js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name: wire.UsageStream, Subjects: []string{wire.UsageSubjectAll}, Storage: jetstream.FileStorage,
		Duplicates: 10 * time.Minute, MaxAge: 7 * 24 * time.Hour,
	})
	require.NoError(t, err)
	return b
}

// run starts a consumer over st until the test ends or stop is called.
func (b *bundle) run(st *store.Store) (*Consumer, func()) {
	b.t.Helper()
	c, err := New(Config{FetchWait: 100 * time.Millisecond, BatchSize: 50, MaxBackoff: 200 * time.Millisecond,
		TxTimeout: 2 * time.Second, AckWait: 5 * time.Second,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, st, b.nc)
	require.NoError(b.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	var once sync.Once
	stop := func() { once.Do(func() { cancel(); <-done }) }
	b.t.Cleanup(stop)
	return c, stop
}

// publish sends ev with msgID as its dedupe id (a different id than the
// request id simulates a copy outside JetStream's dedupe window).
func (b *bundle) publish(ev *usagev1.UsageEvent, msgID string) {
	b.t.Helper()
	data, err := proto.Marshal(ev)
	require.NoError(b.t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = b.js.Publish(ctx, wire.UsageSubject("eu"), data, jetstream.WithMsgID(msgID))
	require.NoError(b.t, err)
}

var day1 = time.Date(2026, 11, 3, 23, 59, 0, 0, time.UTC)

// event i: two orgs, three keys, a tag on even ones, spread over two days.
func event(i int) *usagev1.UsageEvent {
	at := day1.Add(time.Duration(i%3) * time.Minute) // i%3 == 2 is the next day
	ev := &usagev1.UsageEvent{
		RequestId: fmt.Sprintf("req_%05d", i), Time: timestamppb.New(at), Region: "eu", InstanceId: "dp-1",
		OrgId: fmt.Sprintf("org_%d", i%2), TeamId: "team_1", KeyId: fmt.Sprintf("key_%d", i%3),
		ModelGroup: "qwen", DeploymentId: "dep_a", PromptTokens: int64(10 + i), CompletionTokens: int64(i % 7),
		CachedTokens: 1, CacheCreationTokens: int64(i % 4), CostUsd: float64(i) * 0.25, Status: 200,
	}
	if i%2 == 0 {
		ev.Tags = []string{"batch", "batch"} // a repeated tag counts once
	}
	if i%5 == 0 {
		ev.Customer = "acme"
	}
	return ev
}

// want is the aggregate one scope should have over events [0, n).
func want(n int, match func(*usagev1.UsageEvent) bool) store.SpendTotals {
	var t store.SpendTotals
	for i := range n {
		ev := event(i)
		if match(ev) {
			t.Requests++
			t.PromptTokens += ev.PromptTokens
			t.CompletionTokens += ev.CompletionTokens
			t.CachedTokens += ev.CachedTokens
			t.CostUSD += ev.CostUsd
		}
	}
	return t
}

// checkLedger requires exactly n spend_logs rows and aggregates equal to
// the sums of events [0, n).
func (b *bundle) checkLedger(st *store.Store, n int) {
	b.t.Helper()
	ctx := context.Background()
	var rows, distinct int
	require.NoError(b.t, b.pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT request_id) FROM spend_logs`).Scan(&rows, &distinct))
	require.Equal(b.t, n, rows)
	require.Equal(b.t, n, distinct)
	var cacheWrites, wantWrites int64
	require.NoError(b.t, b.pool.QueryRow(ctx, `SELECT coalesce(sum(cache_creation_tokens), 0) FROM spend_logs`).Scan(&cacheWrites))
	for i := range n {
		wantWrites += event(i).CacheCreationTokens
	}
	require.Equal(b.t, wantWrites, cacheWrites, "every row keeps its prompt-cache writes")
	all := store.SpendSumQuery{Start: time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC), End: time.Date(2026, 11, 10, 0, 0, 0, 0, time.UTC)}
	sum := func(scope, id, org string) store.SpendTotals {
		q := all
		q.Scope, q.ScopeID, q.OrgID = scope, id, org
		got, err := st.SpendSum(ctx, q)
		require.NoError(b.t, err)
		return got
	}
	near := func(w, g store.SpendTotals, what string) {
		b.t.Helper()
		require.InDelta(b.t, w.CostUSD, g.CostUSD, 1e-6, what)
		w.CostUSD, g.CostUSD = 0, 0
		require.Equal(b.t, w, g, what)
	}
	near(want(n, func(e *usagev1.UsageEvent) bool { return e.OrgId == "org_0" }), sum(store.SpendScopeOrg, "org_0", ""), "org_0")
	near(want(n, func(e *usagev1.UsageEvent) bool { return e.OrgId == "org_1" }), sum(store.SpendScopeOrg, "org_1", ""), "org_1")
	near(want(n, func(e *usagev1.UsageEvent) bool { return e.KeyId == "key_2" }), sum(store.SpendScopeKey, "key_2", ""), "key_2")
	near(want(n, func(e *usagev1.UsageEvent) bool { return true }), sum(store.SpendScopeTeam, "team_1", ""), "team_1")
	near(want(n, func(e *usagev1.UsageEvent) bool { return true }), sum(store.SpendScopeModelGroup, "qwen", ""), "model group")
	near(want(n, func(e *usagev1.UsageEvent) bool { return e.OrgId == "org_1" }), sum(store.SpendScopeDeployment, "dep_a", "org_1"), "deployment in org_1")
	near(want(n, func(e *usagev1.UsageEvent) bool { return len(e.Tags) > 0 }), sum(store.SpendScopeTag, "batch", ""), "tag")
	near(want(n, func(e *usagev1.UsageEvent) bool { return e.Customer == "acme" }), sum(store.SpendScopeCustomer, "acme", ""), "customer")
	near(store.SpendTotals{}, sum(store.SpendScopeUser, "", ""), "empty user ids are not a scope")
	// Day boundaries: only the events at 23:59 and 00:00 fall on day 1.
	q := all
	q.Scope, q.ScopeID, q.End = store.SpendScopeTeam, "team_1", time.Date(2026, 11, 4, 0, 0, 0, 0, time.UTC)
	got, err := st.SpendSum(ctx, q)
	require.NoError(b.t, err)
	near(want(n, func(e *usagev1.UsageEvent) bool { return e.Time.AsTime().Day() == 3 }), got, "day 1 only")
}

func TestRecordsEveryRequestOnceAndAggregatesItsScopes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	st := store.New(b.pool, nil)
	c, _ := b.run(st)
	const n = 300
	for i := range n {
		b.publish(event(i), event(i).RequestId)
		if i%10 == 0 {
			// A copy JetStream does not dedupe (another message id, as after
			// the dedupe window): the ledger must skip it.
			b.publish(event(i), "copy-"+event(i).RequestId)
		}
	}
	require.Eventually(t, func() bool { s := c.Stats(); return s.Recorded+s.Duplicates == n+n/10 }, 15*time.Second, 20*time.Millisecond)
	s := c.Stats()
	require.Equal(t, int64(n), s.Recorded)
	require.Equal(t, int64(n/10), s.Duplicates)
	b.checkLedger(st, n)
}

func TestUndecodableEventsAreTerminated(t *testing.T) {
	t.Parallel()
	b := setup(t)
	st := store.New(b.pool, nil)
	c, _ := b.run(st)
	ctx := context.Background()
	_, err := b.js.Publish(ctx, wire.UsageSubject("eu"), []byte{0xff, 0xff, 0xff}, jetstream.WithMsgID("garbage"))
	require.NoError(t, err)
	b.publish(&usagev1.UsageEvent{OrgId: "org_0"}, "no-request-id")
	b.publish(event(0), event(0).RequestId)
	require.Eventually(t, func() bool { s := c.Stats(); return s.Undecodable == 2 && s.Recorded == 1 }, 10*time.Second, 20*time.Millisecond)
	// Terminated messages are not redelivered.
	time.Sleep(300 * time.Millisecond)
	require.Equal(t, int64(2), c.Stats().Undecodable)
	cons, err := b.js.Consumer(ctx, wire.UsageStream, DefaultDurable)
	require.NoError(t, err)
	info, err := cons.Info(ctx)
	require.NoError(t, err)
	require.Zero(t, info.NumAckPending)
	require.Zero(t, info.NumPending)
}

func TestPostgresUnreachableNothingLostNothingTwice(t *testing.T) {
	t.Parallel()
	b := setup(t)
	u, err := url.Parse(b.dbURL)
	require.NoError(t, err)
	proxy := startProxy(t, u.Host)
	u.Host = proxy.ln.Addr().String()
	cfg, err := pgxpool.ParseConfig(u.String())
	require.NoError(t, err)
	cfg.ConnConfig.ConnectTimeout = time.Second
	viaProxy, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(viaProxy.Close)
	st := store.New(viaProxy, nil)
	c, _ := b.run(st)

	const n = 200
	for i := range n / 2 {
		b.publish(event(i), event(i).RequestId)
	}
	require.Eventually(t, func() bool { return c.Stats().Recorded == n/2 }, 10*time.Second, 20*time.Millisecond)

	proxy.setDown(true)
	for i := n / 2; i < n; i++ {
		b.publish(event(i), event(i).RequestId)
	}
	require.Eventually(t, func() bool { return c.Stats().Failures >= 2 }, 10*time.Second, 20*time.Millisecond,
		"the consumer keeps failing while Postgres is unreachable")
	require.Equal(t, int64(n/2), c.Stats().Recorded)
	time.Sleep(500 * time.Millisecond)

	proxy.setDown(false)
	require.Eventually(t, func() bool { return c.Stats().Recorded == n }, 20*time.Second, 20*time.Millisecond)
	// Redeliver everything (as after lost acks): nothing changes.
	for i := range n {
		b.publish(event(i), "again-"+event(i).RequestId)
	}
	require.Eventually(t, func() bool { return c.Stats().Duplicates == n }, 20*time.Second, 20*time.Millisecond)
	b.checkLedger(store.New(b.pool, nil), n)
}

func TestReplicasShareTheWorkAndAStoppedConsumerResumes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	st := store.New(b.pool, nil)
	c1, stop1 := b.run(st)
	const n = 400
	for i := range n / 4 {
		b.publish(event(i), event(i).RequestId)
	}
	require.Eventually(t, func() bool { return c1.Stats().Recorded == n/4 }, 10*time.Second, 20*time.Millisecond)
	stop1()
	// Consumer stopped: events wait in the stream.
	for i := n / 4; i < n; i++ {
		b.publish(event(i), event(i).RequestId)
	}
	time.Sleep(200 * time.Millisecond)
	var rows int
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT count(*) FROM spend_logs`).Scan(&rows))
	require.Equal(t, n/4, rows)
	// Two replicas resume on the same durable consumer.
	c2, _ := b.run(st)
	c3, _ := b.run(st)
	require.Eventually(t, func() bool { return c2.Stats().Recorded+c3.Stats().Recorded == n-n/4 }, 20*time.Second, 20*time.Millisecond)
	require.Zero(t, c2.Stats().Duplicates+c3.Stats().Duplicates)
	b.checkLedger(st, n)
}

// TestNULBytesDoNotStallTheLedger: a usage event whose strings carry NUL
// (a request body's "model": "\u0000", which Postgres text refuses) is
// recorded with U+FFFD instead of failing its batch on every redelivery.
func TestNULBytesDoNotStallTheLedger(t *testing.T) {
	t.Parallel()
	b := setup(t)
	st := store.New(b.pool, nil)
	c, _ := b.run(st)
	bad := event(0)
	bad.RequestedModel, bad.Tags = "gpt\x00x", []string{"a\x00"}
	b.publish(bad, bad.RequestId)
	b.publish(event(1), event(1).RequestId)
	require.Eventually(t, func() bool { return c.Stats().Recorded == 2 }, 10*time.Second, 20*time.Millisecond)
	var model string
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT requested_model FROM spend_logs WHERE request_id = $1`, bad.RequestId).Scan(&model))
	require.Equal(t, "gpt\uFFFDx", model)
}
