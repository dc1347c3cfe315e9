package publish

import (
	"context"
	"crypto/rand"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/testsvc"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// compileAt compiles one snapshot with the clock at now, as the leader
// does, and returns it as a data plane reads it from the object store.
func compileAt(t *testing.T, st *store.Store, nc *nats.Conn, now time.Time) *configv1.Snapshot {
	t.Helper()
	ctx := context.Background()
	p, err := New(Config{InstanceID: "test", Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Now: func() time.Time { return now }}, st, nil, nc)
	require.NoError(t, err)
	require.NoError(t, p.ensureInfra(ctx))
	require.NoError(t, p.compile(ctx))
	obs, err := p.js.ObjectStore(ctx, wire.SnapshotBucket)
	require.NoError(t, err)
	body, err := obs.GetBytes(ctx, wire.SnapshotObject(uint64(p.Stats().LastVersion)))
	require.NoError(t, err)
	snap, err := wire.DecodeSnapshot(body, nil)
	require.NoError(t, err)
	require.Equal(t, int64(len(snap.BudgetSeeds)), p.Stats().LastBudgetSeeds)
	return snap
}

// seed is a BudgetSeed for comparisons.
type seed struct {
	org, kind, id, window string
	start, micros         int64
}

func seedsOf(snap *configv1.Snapshot) []seed {
	out := make([]seed, 0, len(snap.GetBudgetSeeds()))
	for _, b := range snap.GetBudgetSeeds() {
		out = append(out, seed{b.GetOrgId(), b.GetKind(), b.GetId(), b.GetWindow(), b.GetWindowStart(), b.GetSpendMicros()})
	}
	return out
}

func TestSnapshotSeedsEveryBudgetedScopeWithItsWindowsLedgerSpend(t *testing.T) {
	t.Parallel()
	pool, _ := testsvc.NewPool(t)
	st := store.New(pool, nil)
	nc, err := nats.Connect(testsvc.StartNATS(t).URL)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	ctx := context.Background()

	// Org A: an org budget per calendar month; team T a soft budget per
	// 7 days and a per-model budget on qwen; user U a budget per 36 hours
	// (windows that do not start at midnight); U's membership of T a
	// budget per day; customer "acme" a monthly budget; key K1 a monthly
	// budget and per-model budgets on qwen and llama. K2, team T2 and org
	// B carry no budget; user U2 has a budget and no spend; K3 (org B) a
	// daily budget and a fraction of a micro-dollar of spend.
	exec := func(sql string, args ...any) {
		t.Helper()
		_, err := pool.Exec(ctx, sql, args...)
		require.NoError(t, err)
	}
	created := time.Date(2026, 10, 1, 0, 0, 0, 0, time.UTC)
	exec(`INSERT INTO orgs (id, name, limits, created_at, updated_at) VALUES
		('org_a', 'a', '{"maxBudget": 100, "budgetDuration": "1mo"}', $1, $1),
		('org_b', 'b', '{}', $1, $1)`, created)
	exec(`INSERT INTO teams (id, org_id, name, limits, created_at, updated_at) VALUES
		('team_t', 'org_a', 't', '{"softBudget": 10, "budgetDuration": "7d", "modelMaxBudget": {"qwen": 5}}', $1, $1),
		('team_t2', 'org_a', 't2', '{}', $1, $1)`, created)
	exec(`INSERT INTO users (id, org_id, email, limits, created_at, updated_at) VALUES
		('user_u', 'org_a', 'u@example.com', '{"maxBudget": 50, "budgetDuration": "36h"}', $1, $1),
		('user_u2', 'org_a', 'u2@example.com', '{"maxBudget": 50, "budgetDuration": "1d"}', $1, $1)`, created)
	exec(`INSERT INTO team_members (team_id, user_id, org_id, max_budget_in_team, limits, created_at, updated_at) VALUES
		('team_t', 'user_u', 'org_a', 20, '{"budgetDuration": "1d"}', $1, $1),
		('team_t2', 'user_u', 'org_a', NULL, '{}', $1, $1)`, created)
	exec(`INSERT INTO customers (id, org_id, external_id, limits, created_at, updated_at) VALUES
		('cus_a', 'org_a', 'acme', '{"maxBudget": 30, "budgetDuration": "1mo"}', $1, $1),
		('cus_b', 'org_b', 'acme', '{}', $1, $1)`, created)
	mkKey := func(id, org, team, user, limits string) {
		t.Helper()
		hash := make([]byte, 32)
		_, _ = rand.Read(hash)
		var teamID, userID *string
		if team != "" {
			teamID = &team
		}
		if user != "" {
			userID = &user
		}
		exec(`INSERT INTO keys (id, org_id, team_id, user_id, token_hash, pepper_version, display_prefix, last4, limits, created_at, updated_at)
			VALUES ($1, $2, $3, $4, $5, 1, 'sk-sluice-x', 'abcd', $6, $7, $7)`, id, org, teamID, userID, hash, limits, created)
	}
	mkKey("key_k1", "org_a", "team_t", "user_u", `{"maxBudget": 10, "budgetDuration": "1mo", "modelMaxBudget": {"qwen": 3, "llama": 2}}`)
	mkKey("key_k2", "org_a", "team_t", "user_u", `{}`)
	mkKey("key_k3", "org_b", "", "", `{"maxBudget": 1, "budgetDuration": "1d"}`)

	// The ledger, written as the spend consumer writes it (spend_logs and
	// spend_daily). Costs are powers of two so every sum is exact.
	at := func(s string) time.Time {
		tm, err := time.Parse(time.RFC3339, s)
		require.NoError(t, err)
		return tm
	}
	type log = store.SpendLog
	_, err = st.SpendRecord(ctx, []log{
		{RequestID: "r01", At: at("2026-10-31T23:59:59Z"), OrgID: "org_a", TeamID: "team_t", UserID: "user_u", KeyID: "key_k1", ModelGroup: "qwen", Customer: "acme", CostUSD: 1},
		{RequestID: "r02", At: at("2026-11-01T00:00:00Z"), OrgID: "org_a", TeamID: "team_t", UserID: "user_u", KeyID: "key_k1", ModelGroup: "qwen", Customer: "acme", CostUSD: 2},
		{RequestID: "r03", At: at("2026-11-12T00:00:00Z"), OrgID: "org_a", TeamID: "team_t", UserID: "user_u", KeyID: "key_k1", ModelGroup: "mistral", CostUSD: 4},
		{RequestID: "r04", At: at("2026-11-16T11:00:00Z"), OrgID: "org_a", TeamID: "team_t", UserID: "user_u", KeyID: "key_k2", ModelGroup: "qwen", CostUSD: 8},
		{RequestID: "r05", At: at("2026-11-16T13:00:00Z"), OrgID: "org_a", TeamID: "team_t", UserID: "user_u", KeyID: "key_k1", ModelGroup: "qwen", Customer: "acme", CostUSD: 16},
		{RequestID: "r06", At: at("2026-11-17T09:00:00Z"), OrgID: "org_a", TeamID: "team_t", UserID: "user_u", KeyID: "key_k1", ModelGroup: "qwen", CostUSD: 32},
		{RequestID: "r07", At: at("2026-11-17T10:00:00Z"), OrgID: "org_a", TeamID: "team_t2", UserID: "user_u", KeyID: "key_k2", ModelGroup: "qwen", CostUSD: 64},
		// After the compile, still in some windows (a data plane's clock
		// ahead of the control plane's).
		{RequestID: "r08", At: at("2026-11-18T01:00:00Z"), OrgID: "org_a", TeamID: "team_t", UserID: "user_u", KeyID: "key_k1", ModelGroup: "qwen", CostUSD: 128},
		{RequestID: "r09", At: at("2026-11-17T08:00:00Z"), OrgID: "org_b", KeyID: "key_k3", Customer: "acme", CostUSD: 256},
		{RequestID: "r10", At: at("2026-12-01T00:00:00Z"), OrgID: "org_a", TeamID: "team_t", UserID: "user_u", KeyID: "key_k1", ModelGroup: "qwen", CostUSD: 512},
		{RequestID: "r11", At: at("2026-11-17T08:30:00Z"), OrgID: "org_b", KeyID: "key_k3", CostUSD: 0.0000011},
	})
	require.NoError(t, err)

	now := at("2026-11-17T10:30:00Z")
	snap := compileAt(t, st, nc, now)
	const usd = 1_000_000
	nov1 := at("2026-11-01T00:00:00Z").Unix()
	want := []seed{
		// r03–r08: r08 is after the compile but inside the 7-day window
		// [11-12, 11-19); r07 belongs to team T2.
		{"org_a", "customer", "cus_a", "1mo", nov1, (2 + 16) * usd},
		{"org_a", "key", "key_k1", "1mo", nov1, (2 + 4 + 16 + 32 + 128) * usd},
		// 1.1 micro-dollars round up.
		{"org_b", "key", "key_k3", "1d", at("2026-11-17T00:00:00Z").Unix(), 256*usd + 2},
		// K1/llama spent nothing: no seed.
		{"org_a", "key_model", "key_k1/qwen", "1mo", nov1, (2 + 16 + 32 + 128) * usd},
		{"org_a", "member", "team_t/user_u", "1d", at("2026-11-17T00:00:00Z").Unix(), 32 * usd},
		{"org_a", "org", "org_a", "1mo", nov1, (2 + 4 + 8 + 16 + 32 + 64 + 128) * usd},
		{"org_a", "team", "team_t", "7d", at("2026-11-12T00:00:00Z").Unix(), (4 + 8 + 16 + 32 + 128) * usd},
		{"org_a", "team_model", "team_t/qwen", "7d", at("2026-11-12T00:00:00Z").Unix(), (8 + 16 + 32 + 128) * usd},
		// [11-16 12:00, 11-18 00:00): r05 from the logs of 11-16, r06 and
		// r07 from the daily aggregate of 11-17; r04 (11:00) is before it.
		{"org_a", "user", "user_u", "36h", at("2026-11-16T12:00:00Z").Unix(), (16 + 32 + 64) * usd},
	}
	require.Equal(t, want, seedsOf(snap))

	// On December 1st every window has moved on: only r10 counts, in the
	// windows that contain it.
	snap = compileAt(t, st, nc, at("2026-12-01T00:00:00Z"))
	dec1 := at("2026-12-01T00:00:00Z").Unix()
	nov26 := at("2026-11-26T00:00:00Z").Unix()
	require.Equal(t, []seed{
		{"org_a", "key", "key_k1", "1mo", dec1, 512 * usd},
		{"org_a", "key_model", "key_k1/qwen", "1mo", dec1, 512 * usd},
		{"org_a", "member", "team_t/user_u", "1d", dec1, 512 * usd},
		{"org_a", "org", "org_a", "1mo", dec1, 512 * usd},
		{"org_a", "team", "team_t", "7d", nov26, 512 * usd},
		{"org_a", "team_model", "team_t/qwen", "7d", nov26, 512 * usd},
		{"org_a", "user", "user_u", "36h", at("2026-11-30T00:00:00Z").Unix(), 512 * usd},
	}, seedsOf(snap))
}
