package limits

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/internal/testsvc"
)

// testCluster is the Redis Cluster of TestClusterStore's subtests
// (setup picks it for tests under "cluster/").
var testCluster atomic.Pointer[testsvc.RedisCluster]

// startCluster starts a 3-master Redis Cluster for one test.
func startCluster(t *testing.T) []string { return testsvc.StartRedisCluster(t).Addrs }

// TestClusterStore runs the limiter's tests on a 3-master Redis Cluster,
// with the same assertions as on one Redis: admission, renewal,
// settlement (single and batched across orgs), cancellation, leases,
// budget seeds, peeks, sweeps, quota slices and prefill isolation gates. Every script call's keys
// must share one slot (a call touching two fails with CROSSSLOT), and the
// results must be those of the single-node run.
func TestClusterStore(t *testing.T) {
	testCluster.Store(testsvc.StartRedisCluster(t))
	for _, tc := range []struct {
		name string
		f    func(*testing.T)
	}{
		{"AdmitAllOrNothing", TestAdmitAllOrNothing}, {"RPMSlidingWindow", TestRPMSlidingWindow},
		{"TPMReconcile", TestTPMReconcile}, {"LeasesReleaseAndHeal", TestLeasesReleaseAndHeal},
		{"SettleIdempotent", TestSettleIdempotent}, {"BudgetReserveReconcile", TestBudgetReserveReconcile},
		{"BudgetConcurrentNeverOvershoots", TestBudgetConcurrentNeverOvershoots},
		{"EpochQuarantineAfterStateLoss", TestEpochQuarantineAfterStateLoss},
		{"BootstrapSkipsQuarantineOnlyForNewOrgs", TestBootstrapSkipsQuarantineOnlyForNewOrgs},
		{"SettleWithoutRecordChargesActual", TestSettleWithoutRecordChargesActual},
		{"SettleBatch", TestSettleBatch}, {"CancelUndoesALateAdmission", TestCancelUndoesALateAdmission},
		{"Peek", TestPeekReadsWhatAdmissionCountsAndWritesNothing},
		{"UnseededAdmitsNothingUntilSeeded", TestUnseededAdmitsNothingUntilSeeded},
		{"WriteSeedsNeverOverwrites", TestWriteSeedsNeverOverwrites},
		{"ReassertedReservationJoinsTheSeed", TestReassertedReservationJoinsTheSeed},
		{"SweepSettlesALostRequest", TestSweepSettlesALostRequestWithItsLastReport}, {"SweepersRace", TestSweepersRace},
		{"SweepAfterStateLoss", TestSweepAfterStateLoss},
		{"SlicesZeroRoundTrips", TestSlicesZeroRoundTrips},
		{"GateIsolation", TestGateIsolation}, {"GateJoinWindow", TestGateJoinWindow}, {"GateEntriesExpire", TestGateEntriesExpire},
		{"AdmitBatchConcurrencyCapExact", TestAdmitBatchConcurrencyCapExact},
	} {
		t.Run("cluster/"+tc.name, tc.f)
	}
}

// TestCluster runs admission, renewal and settlement with every scope kind
// on a 3-node Redis Cluster: a script touching keys of two slots would fail
// with CROSSSLOT, so passing proves every key of a call shares the org's slot.
func TestCluster(t *testing.T) {
	t.Parallel()
	addrs := startCluster(t)
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = rdb.Close() })
	// Budget windows are seeded (seed.lua) on the cluster too.
	led := &fakeLedger{}
	lim, err := New(Config{Client: rdb, KeyPrefix: "sluice:", CallTimeout: time.Second, Quarantine: time.Millisecond, Seeds: led.seeds})
	require.NoError(t, err)
	ctx := context.Background()

	budget := func(w string) *Budget { return &Budget{CapMicros: 1e9, Window: w} }
	slots := map[int64]bool{}
	for o := range 12 {
		org := fmt.Sprintf("org-%d", o)
		slot, err := rdb.ClusterKeySlot(ctx, newKeyBuilder("sluice:", org).epoch()).Result()
		require.NoError(t, err)
		slots[slot] = true
		scopes := []Scope{
			{Kind: KindKey, ID: "k", RPM: 100, TPM: 1e6, MaxParallel: 10, Budget: budget("30d")},
			{Kind: KindUser, ID: "u", MaxParallel: 10, Budget: budget("1mo")},
			{Kind: KindMember, ID: "t/u", Budget: budget("7d")},
			{Kind: KindTeam, ID: "t", RPM: 100, MaxParallel: 10, Budget: budget("1d")},
			{Kind: KindOrg, ID: org, TPM: 1e6, Budget: budget("12mo")},
			{Kind: KindCustomer, ID: "c", RPM: 100, Budget: budget("24h")},
			{Kind: KindKeyModel, ID: "k/qwen-30b", RPM: 100, TPM: 1e6, Budget: budget("1d")},
			{Kind: KindTeamModel, ID: "t/qwen-30b", TPM: 1e6, Budget: budget("1d")},
			{Kind: KindDeployment, ID: "vllm-a", MaxParallel: 10},
		}
		time.Sleep(2 * time.Millisecond) // past the first-use quarantine
		for r := range 3 {
			req := Request{OrgID: org, RequestID: fmt.Sprint("r", r), Scopes: scopes, EstTokens: 100, MaxCostMicros: 1000}
			d, err := lim.Admit(ctx, req)
			require.NoError(t, err)
			if !d.Allowed {
				// The very first call of an org starts its epoch.
				require.True(t, d.Rejection.Quarantined, "%+v", d.Rejection)
				time.Sleep(5 * time.Millisecond)
				d, err = lim.Admit(ctx, req)
				require.NoError(t, err)
			}
			require.True(t, d.Allowed, "%+v", d.Rejection)
			st, err := lim.Renew(ctx, d.Lease)
			require.NoError(t, err)
			require.Equal(t, RenewExtended, st)
			res, err := lim.Settle(ctx, d.Lease, 90, 800)
			require.NoError(t, err)
			require.True(t, res.Applied)
		}
		n, err := rdb.ZCard(ctx, newKeyBuilder("sluice:", org).scope(&scopes[8])[1]).Result()
		require.NoError(t, err)
		require.Zero(t, n)
	}
	require.Greater(t, len(slots), 1, "orgs spread over several slots")
}
