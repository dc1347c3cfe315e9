package seeds

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/spend"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/budget"
	"github.com/sluicegw/sluice/internal/testsvc"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// env is a responder on its own Postgres database and NATS server.
type env struct {
	t    *testing.T
	pool *pgxpool.Pool
	st   *store.Store
	nc   *nats.Conn
	js   jetstream.JetStream
	r    *Responder
}

func setup(t *testing.T, cfg Config) *env {
	t.Helper()
	pool, _ := testsvc.NewPool(t)
	nc, err := nats.Connect(testsvc.StartNATS(t).URL)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	e := &env{t: t, pool: pool, st: store.New(pool, nil), nc: nc, js: js}
	e.r = e.startResponder(cfg)
	return e
}

// startResponder runs a responder (a control-plane replica's) until the
// test ends.
func (e *env) startResponder(cfg Config) *Responder {
	e.t.Helper()
	if cfg.Durable == "" {
		cfg.Durable = spend.DefaultDurable
	}
	r, err := New(cfg, e.st, e.nc)
	require.NoError(e.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = r.Run(ctx) }()
	e.t.Cleanup(func() { cancel(); <-done })
	// The subscription is live once a request is answered.
	require.Eventually(e.t, func() bool {
		_, err := e.nc.Request(wire.BudgetSeedSubject, []byte{0xff}, time.Second)
		return err == nil
	}, 10*time.Second, 10*time.Millisecond)
	return r
}

// ask sends a seed request as a data plane does and returns the reply.
func (e *env) ask(org string, wait time.Duration, scopes ...*configv1.BudgetSeed) *configv1.BudgetSeedReply {
	e.t.Helper()
	data, err := wire.Marshal(&configv1.BudgetSeedRequest{OrgId: org, Scopes: scopes, WaitMs: wait.Milliseconds()})
	require.NoError(e.t, err)
	msg, err := e.nc.Request(wire.BudgetSeedSubject, data, wait+5*time.Second)
	require.NoError(e.t, err)
	var rep configv1.BudgetSeedReply
	require.NoError(e.t, wire.Unmarshal(msg.Data, &rep))
	return &rep
}

func scope(org, kind, id, window string, start time.Time) *configv1.BudgetSeed {
	return &configv1.BudgetSeed{OrgId: org, Kind: kind, Id: id, Window: window, WindowStart: start.Unix()}
}

func at(t *testing.T, s string) time.Time {
	t.Helper()
	tm, err := time.Parse(time.RFC3339, s)
	require.NoError(t, err)
	return tm
}

// seedLedger writes the ledger of TestSeedsAreTheLedgerSpendOfEveryKind as
// the spend consumer does (spend_logs and spend_daily). Costs are powers of
// two so every sum is exact.
func (e *env) seedLedger() {
	t := e.t
	ctx := context.Background()
	exec := func(sql string, args ...any) {
		t.Helper()
		_, err := e.pool.Exec(ctx, sql, args...)
		require.NoError(t, err)
	}
	created := at(t, "2026-10-01T00:00:00Z")
	exec(`INSERT INTO orgs (id, name, limits, created_at, updated_at) VALUES ('org_a', 'a', '{}', $1, $1), ('org_b', 'b', '{}', $1, $1)`, created)
	exec(`INSERT INTO customers (id, org_id, external_id, limits, created_at, updated_at) VALUES
		('cus_a', 'org_a', 'acme', '{}', $1, $1), ('cus_b', 'org_b', 'acme', '{}', $1, $1)`, created)
	type log = store.SpendLog
	_, err := e.st.SpendRecord(ctx, []log{
		{RequestID: "r01", At: at(t, "2026-10-31T23:59:59Z"), OrgID: "org_a", TeamID: "team_t", UserID: "user_u", KeyID: "key_k1", ModelGroup: "qwen", Customer: "acme", CostUSD: 1},
		{RequestID: "r02", At: at(t, "2026-11-01T00:00:00Z"), OrgID: "org_a", TeamID: "team_t", UserID: "user_u", KeyID: "key_k1", ModelGroup: "qwen", Customer: "acme", CostUSD: 2},
		{RequestID: "r03", At: at(t, "2026-11-12T00:00:00Z"), OrgID: "org_a", TeamID: "team_t", UserID: "user_u", KeyID: "key_k1", ModelGroup: "mistral", CostUSD: 4},
		{RequestID: "r04", At: at(t, "2026-11-16T11:00:00Z"), OrgID: "org_a", TeamID: "team_t", UserID: "user_u", KeyID: "key_k2", ModelGroup: "qwen", CostUSD: 8},
		{RequestID: "r05", At: at(t, "2026-11-16T13:00:00Z"), OrgID: "org_a", TeamID: "team_t", UserID: "user_u", KeyID: "key_k1", ModelGroup: "qwen", Customer: "acme", CostUSD: 16},
		{RequestID: "r06", At: at(t, "2026-11-17T09:00:00Z"), OrgID: "org_a", TeamID: "team_t", UserID: "user_u", KeyID: "key_k1", ModelGroup: "qwen", CostUSD: 32},
		{RequestID: "r07", At: at(t, "2026-11-17T10:00:00Z"), OrgID: "org_a", TeamID: "team_t2", UserID: "user_u", KeyID: "key_k2", ModelGroup: "qwen", CostUSD: 64},
		{RequestID: "r08", At: at(t, "2026-11-18T01:00:00Z"), OrgID: "org_a", TeamID: "team_t", UserID: "user_u", KeyID: "key_k1", ModelGroup: "qwen", CostUSD: 128},
		{RequestID: "r09", At: at(t, "2026-11-17T08:00:00Z"), OrgID: "org_b", KeyID: "key_k3", Customer: "acme", CostUSD: 256},
		{RequestID: "r10", At: at(t, "2026-12-01T00:00:00Z"), OrgID: "org_a", TeamID: "team_t", UserID: "user_u", KeyID: "key_k1", ModelGroup: "qwen", CostUSD: 512},
		{RequestID: "r11", At: at(t, "2026-11-17T08:30:00Z"), OrgID: "org_b", KeyID: "key_k3", CostUSD: 0.0000011},
	})
	require.NoError(t, err)
}

// TestSeedsAreTheLedgerSpendOfEveryKind: for every budget kind, the answer
// is the ledger's spend of exactly the window asked for (spend_daily for
// whole days, spend_logs at the edges), matched on the kind's columns.
func TestSeedsAreTheLedgerSpendOfEveryKind(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.seedLedger()
	const usd = 1_000_000
	nov1, nov12, nov17 := at(t, "2026-11-01T00:00:00Z"), at(t, "2026-11-12T00:00:00Z"), at(t, "2026-11-17T00:00:00Z")
	for _, c := range []struct {
		name   string
		org    string
		scope  *configv1.BudgetSeed
		micros int64
	}{
		// r02 r05 (r01 is October's; org B's "acme" is another customer).
		{"customer", "org_a", scope("org_a", "customer", "cus_a", "1mo", nov1), (2 + 16) * usd},
		// r02 r03 r05 r06 r08: r08 is in November though after the 17th.
		{"key", "org_a", scope("org_a", "key", "key_k1", "1mo", nov1), (2 + 4 + 16 + 32 + 128) * usd},
		// 1.1 micro-dollars round up.
		{"key, fractions", "org_b", scope("org_b", "key", "key_k3", "1d", nov17), 256*usd + 2},
		{"key_model", "org_a", scope("org_a", "key_model", "key_k1/qwen", "1mo", nov1), (2 + 16 + 32 + 128) * usd},
		{"key_model without spend", "org_a", scope("org_a", "key_model", "key_k1/llama", "1mo", nov1), 0},
		{"member", "org_a", scope("org_a", "member", "team_t/user_u", "1d", nov17), 32 * usd},
		{"org", "org_a", scope("org_a", "org", "org_a", "1mo", nov1), (2 + 4 + 8 + 16 + 32 + 64 + 128) * usd},
		// [11-12, 11-19): r07 belongs to team T2.
		{"team", "org_a", scope("org_a", "team", "team_t", "7d", nov12), (4 + 8 + 16 + 32 + 128) * usd},
		{"team_model", "org_a", scope("org_a", "team_model", "team_t/qwen", "7d", nov12), (8 + 16 + 32 + 128) * usd},
		// [11-16 12:00, 11-18 00:00): r05 from the logs of 11-16, r06 and
		// r07 from the daily aggregate of 11-17; r04 (11:00) is before it.
		{"user, 36h", "org_a", scope("org_a", "user", "user_u", "36h", at(t, "2026-11-16T12:00:00Z")), (16 + 32 + 64) * usd},
		// December: only r10.
		{"next month", "org_a", scope("org_a", "key", "key_k1", "1mo", at(t, "2026-12-01T00:00:00Z")), 512 * usd},
	} {
		rep := e.ask(c.org, time.Second, c.scope)
		require.Empty(t, rep.GetError(), c.name)
		require.Len(t, rep.GetSeeds(), 1, c.name)
		got := rep.GetSeeds()[0]
		require.Equal(t, c.micros, got.GetSpendMicros(), c.name)
		require.Equal(t, []any{c.org, c.scope.Kind, c.scope.Id, c.scope.Window, c.scope.WindowStart},
			[]any{got.GetOrgId(), got.GetKind(), got.GetId(), got.GetWindow(), got.GetWindowStart()}, c.name)
	}

	// Several scopes in one request: one seed each, in order.
	rep := e.ask("org_a", time.Second, scope("", "org", "org_a", "1mo", nov1), scope("", "key", "key_k2", "1d", nov17))
	require.Empty(t, rep.GetError())
	require.Equal(t, []int64{(2 + 4 + 8 + 16 + 32 + 64 + 128) * usd, 64 * usd},
		[]int64{rep.GetSeeds()[0].GetSpendMicros(), rep.GetSeeds()[1].GetSpendMicros()})
}

// TestSeedsRefuseInvalidRequests: each invalid request is answered with
// an error naming what is wrong.
func TestSeedsRefuseInvalidRequests(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.seedLedger()
	nov1 := at(t, "2026-11-01T00:00:00Z")
	for _, c := range []struct {
		org   string
		scope *configv1.BudgetSeed
		want  string
	}{
		{"", scope("", "key", "k", "1mo", nov1), "org_id is empty"},
		{"org_a", scope("org_b", "key", "k", "1mo", nov1), "is not the request's"},
		{"org_a", scope("", "deployment", "d", "1mo", nov1), "has no budget"},
		{"org_a", scope("", "key", "k", "2w", nov1), "2w"},
		{"org_a", scope("", "key", "k", "1mo", nov1.Add(time.Hour)), "is not the start of a 1mo window"},
		{"org_a", scope("", "member", "team_t", "1mo", nov1), "id \"team_t\" of kind member"},
		{"org_a", scope("", "org", "org_b", "1mo", nov1), "org scope"},
		{"org_a", scope("", "customer", "cus_b", "1mo", nov1), "no customer \"cus_b\" in org \"org_a\""},
		{"org_a", scope("", "key", "", "1mo", nov1), "id \"\""},
	} {
		rep := e.ask(c.org, time.Second, c.scope)
		require.Contains(t, rep.GetError(), c.want)
		require.Empty(t, rep.GetSeeds())
	}
	require.Contains(t, e.ask("org_a", time.Second).GetError(), "0 scopes")
	require.Positive(t, e.r.Stats().Failed)
}

// usageEvent is a usage event of key "key_s" of org "org_s" as a data plane
// publishes it.
func usageEvent(id string, cost float64, start time.Time) *usagev1.UsageEvent {
	return &usagev1.UsageEvent{RequestId: id, Time: timestamppb.New(start), Region: "default", OrgId: "org_s",
		TeamId: "team_s", KeyId: "key_s", ModelGroup: "m", CostUsd: cost, Status: 200}
}

func (e *env) publish(evs ...*usagev1.UsageEvent) {
	e.t.Helper()
	for _, ev := range evs {
		data, err := wire.Marshal(ev)
		require.NoError(e.t, err)
		_, err = e.js.Publish(context.Background(), wire.UsageSubject("default"), data, jetstream.WithMsgID(ev.GetRequestId()))
		require.NoError(e.t, err)
	}
}

func (e *env) usageStream() {
	e.t.Helper()
	_, err := e.js.CreateOrUpdateStream(context.Background(), jetstream.StreamConfig{
		Name: wire.UsageStream, Subjects: []string{wire.UsageSubjectAll}, Storage: jetstream.FileStorage,
		Duplicates: 2 * time.Minute})
	require.NoError(e.t, err)
}

// startLedger runs the spend consumer (a control-plane replica's ledger)
// until stop is called or the test ends.
func (e *env) startLedger() (stop func()) {
	e.t.Helper()
	c, err := spend.New(spend.Config{FetchWait: 200 * time.Millisecond}, e.st, e.nc)
	require.NoError(e.t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	stop = func() { cancel(); <-done }
	e.t.Cleanup(stop)
	return stop
}

func (e *env) ledgerRows() int {
	e.t.Helper()
	var n int
	require.NoError(e.t, e.pool.QueryRow(context.Background(), `SELECT count(*) FROM spend_logs WHERE key_id = 'key_s'`).Scan(&n))
	return n
}

// TestSeedsIncludeEventsStillInTheStream: usage events published to
// SLUICE_USAGE but not yet recorded in Postgres when the request arrives
// are in the answer (it waits for the ledger to record them); events of
// other windows are not.
func TestSeedsIncludeEventsStillInTheStream(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.usageStream()
	start, _, err := budget.Window("1d", time.Now())
	require.NoError(t, err)
	stop := e.startLedger()
	e.publish(usageEvent("a1", 0.25, start.Add(time.Minute)), usageEvent("a2", 0.5, start.Add(-time.Minute)))
	require.Eventually(t, func() bool { return e.ledgerRows() == 2 }, 10*time.Second, 10*time.Millisecond)
	rep := e.ask("org_s", time.Second, scope("org_s", "key", "key_s", "1d", start))
	require.Empty(t, rep.GetError())
	require.Equal(t, int64(250_000), rep.GetSeeds()[0].GetSpendMicros(), "a2 is in the previous window")

	// The ledger stops; two more events reach the stream and stay there.
	stop()
	e.publish(usageEvent("b1", 1, start.Add(2*time.Minute)), usageEvent("b2", 2, start.Add(3*time.Minute)))
	got := make(chan *configv1.BudgetSeedReply, 1)
	go func() { got <- e.ask("org_s", 20*time.Second, scope("org_s", "key", "key_s", "1d", start)) }()
	// The responder waits for the ledger: a poll of the consumer made after
	// the request arrived found the events unrecorded.
	require.Eventually(t, func() bool {
		e.r.wm.mu.Lock()
		defer e.r.wm.mu.Unlock()
		return e.r.wm.waiters == 1 && e.r.wm.doneGen > 0
	}, 10*time.Second, 5*time.Millisecond)
	require.Equal(t, 2, e.ledgerRows(), "b1 and b2 are only in the stream")
	select {
	case r := <-got:
		t.Fatalf("answered before the ledger recorded the stream: %v", r)
	default:
	}

	// The ledger resumes: the answer includes what it records.
	e.startLedger()
	var r *configv1.BudgetSeedReply
	select {
	case r = <-got:
	case <-time.After(25 * time.Second):
		t.Fatal("no answer once the ledger caught up")
	}
	require.Empty(t, r.GetError())
	require.Equal(t, int64(3_250_000), r.GetSeeds()[0].GetSpendMicros(), "a1 + b1 + b2")
	require.Equal(t, 4, e.ledgerRows())
}

// TestSeedsAnswerAnErrorWhenTheLedgerIsBehind: a ledger that does not
// record the stream within the wait, or a Postgres that is down, is an
// error reply (the data plane keeps the scope closed), within the wait.
func TestSeedsAnswerAnErrorWhenTheLedgerIsBehind(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.usageStream()
	start, _, err := budget.Window("1d", time.Now())
	require.NoError(t, err)
	e.publish(usageEvent("c1", 1, start.Add(time.Minute)))
	// No ledger consumer runs: the event stays unrecorded.
	began := time.Now()
	rep := e.ask("org_s", 500*time.Millisecond, scope("org_s", "key", "key_s", "1d", start))
	took := time.Since(began)
	require.Contains(t, rep.GetError(), "the ledger has not recorded the usage stream within the wait")
	require.Empty(t, rep.GetSeeds())
	require.Less(t, took, 5*time.Second, "the wait is bounded by wait_ms")

	// Postgres goes away (the pool is closed; nothing waits in this
	// responder's usage stream): an error, never a guess.
	down, _ := testsvc.NewPool(t)
	nc, err := nats.Connect(testsvc.StartNATS(t).URL)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	r2, err := New(Config{Durable: spend.DefaultDurable}, store.New(down, nil), nc)
	require.NoError(t, err)
	down.Close()
	_, err = r2.Answer(context.Background(), &configv1.BudgetSeedRequest{OrgId: "org_x",
		Scopes: []*configv1.BudgetSeed{scope("org_x", "key", "key_x", "1d", start)}})
	require.ErrorIs(t, err, errLedgerDown)
}

// TestSeedsAnyReplicaAnswers: with several responders (control-plane
// replicas) in the queue group, every request is answered exactly once.
func TestSeedsAnyReplicaAnswers(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	e.seedLedger()
	r2 := e.startResponder(Config{})
	base := e.r.Stats().Answered + r2.Stats().Answered + e.r.Stats().Failed + r2.Stats().Failed
	const n = 40
	for i := range n {
		rep := e.ask("org_a", time.Second, scope("org_a", "key", fmt.Sprint("key_", i), "1mo", at(t, "2026-11-01T00:00:00Z")))
		require.Empty(t, rep.GetError())
	}
	s1, s2 := e.r.Stats(), r2.Stats()
	require.Equal(t, int64(n), s1.Answered+s2.Answered+s1.Failed+s2.Failed-base)
	require.Positive(t, s1.Answered)
	require.Positive(t, s2.Answered)
}

// TestSeedsOfProjectAndTagScopes: a project (tag) scope's seed is the
// ledger spend of its org's requests whose key carried the project (the
// tag) in the window: whole days from spend_daily, edges from spend_logs.
// The scope is named by its id; a scope of another org or of the other
// kind is refused.
func TestSeedsOfProjectAndTagScopes(t *testing.T) {
	t.Parallel()
	e := setup(t, Config{})
	ctx := context.Background()
	exec := func(sql string, args ...any) {
		t.Helper()
		_, err := e.pool.Exec(ctx, sql, args...)
		require.NoError(t, err)
	}
	created := at(t, "2026-10-01T00:00:00Z")
	exec(`INSERT INTO orgs (id, name, limits, created_at, updated_at) VALUES ('org_a', 'a', '{}', $1, $1), ('org_b', 'b', '{}', $1, $1)`, created)
	exec(`INSERT INTO label_scopes (id, org_id, kind, name, limits, created_at, updated_at) VALUES
		('lsc_p', 'org_a', 'project', 'search', '{}', $1, $1), ('lsc_t', 'org_a', 'tag', 'nightly', '{}', $1, $1),
		('lsc_pb', 'org_b', 'project', 'search', '{}', $1, $1)`, created)
	type log = store.SpendLog
	_, err := e.st.SpendRecord(ctx, []log{
		{RequestID: "p1", At: at(t, "2026-10-31T23:59:59Z"), OrgID: "org_a", KeyID: "key_1", Project: "search", CostUSD: 1},
		{RequestID: "p2", At: at(t, "2026-11-01T00:00:00Z"), OrgID: "org_a", KeyID: "key_1", Project: "search", Tags: []string{"nightly"}, CostUSD: 2},
		{RequestID: "p3", At: at(t, "2026-11-16T11:00:00Z"), OrgID: "org_a", KeyID: "key_2", Project: "search", Tags: []string{"a", "nightly"}, CostUSD: 4},
		{RequestID: "p4", At: at(t, "2026-11-16T13:00:00Z"), OrgID: "org_a", KeyID: "key_2", Project: "other", Tags: []string{"nightly"}, CostUSD: 8},
		{RequestID: "p5", At: at(t, "2026-11-17T09:00:00Z"), OrgID: "org_a", KeyID: "key_3", Project: "search", Tags: []string{"nightly"}, CostUSD: 16},
		{RequestID: "p6", At: at(t, "2026-11-17T10:00:00Z"), OrgID: "org_b", KeyID: "key_4", Project: "search", Tags: []string{"nightly"}, CostUSD: 32},
		{RequestID: "p7", At: at(t, "2026-11-18T01:00:00Z"), OrgID: "org_a", KeyID: "key_1", Tags: []string{"nightly"}, CostUSD: 64},
	})
	require.NoError(t, err)
	const usd = 1_000_000
	nov1 := at(t, "2026-11-01T00:00:00Z")
	for _, c := range []struct {
		name   string
		org    string
		scope  *configv1.BudgetSeed
		micros int64
	}{
		// p2 p3 p5 (p1 is October's, p4 another project, p6 org B's).
		{"project, 1mo", "org_a", scope("org_a", budget.KindProject, "lsc_p", "1mo", nov1), (2 + 4 + 16) * usd},
		{"project of org B", "org_b", scope("org_b", budget.KindProject, "lsc_pb", "1mo", nov1), 32 * usd},
		// [11-16 12:00, 11-18 00:00): p4 from the logs of 11-16, p5 from
		// the daily aggregate of 11-17; p3 (11:00) is before, p7 after.
		{"tag, 36h", "org_a", scope("org_a", budget.KindTag, "lsc_t", "36h", at(t, "2026-11-16T12:00:00Z")), (8 + 16) * usd},
		{"tag, 1mo", "org_a", scope("org_a", budget.KindTag, "lsc_t", "1mo", nov1), (2 + 4 + 8 + 16 + 64) * usd},
	} {
		rep := e.ask(c.org, time.Second, c.scope)
		require.Empty(t, rep.GetError(), c.name)
		require.Len(t, rep.GetSeeds(), 1, c.name)
		require.Equal(t, c.micros, rep.GetSeeds()[0].GetSpendMicros(), c.name)
	}
	for _, c := range []struct {
		org   string
		scope *configv1.BudgetSeed
		want  string
	}{
		{"org_a", scope("", budget.KindProject, "lsc_pb", "1mo", nov1), `no project scope "lsc_pb" in org "org_a"`},
		{"org_a", scope("", budget.KindTag, "lsc_p", "1mo", nov1), `no tag scope "lsc_p" in org "org_a"`},
	} {
		rep := e.ask(c.org, time.Second, c.scope)
		require.Contains(t, rep.GetError(), c.want)
		require.Empty(t, rep.GetSeeds())
	}
}
