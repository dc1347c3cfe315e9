package system

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/sluicegw/sluice/e2e/harness"

	"connectrpc.com/connect"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// rolloutStatus returns the rollout status: the latest version and each
// region's current version.
func rolloutStatus(t testing.TB, c adminClients) (*adminv1.GetRolloutStatusResponse, map[string]*adminv1.RegionStatus) {
	t.Helper()
	resp, err := c.Rollout.GetRolloutStatus(context.Background(), connect.NewRequest(&adminv1.GetRolloutStatusRequest{}))
	require.NoError(t, err)
	regions := map[string]*adminv1.RegionStatus{}
	for _, r := range resp.Msg.GetRegions() {
		regions[r.GetRegion().GetName()] = r
	}
	return resp.Msg, regions
}

// waitVersion waits until p runs config version v.
func waitVersion(t testing.TB, p *proxy, v uint64, within time.Duration) {
	t.Helper()
	harness.Eventually(t, func() bool { return p.DP.Catalog().Version == v }, within, 5*time.Millisecond,
		"proxy %s runs version %d, want %d", p.URL, p.DP.Catalog().Version, v)
}

// TestRolloutStagedRegion runs an auto region (eu) and a staged one (us):
// new config versions go live in eu at once and wait for promotion in us;
// promotion and rollback move us between versions; a block issued while us
// is held on an older version reaches it at once and survives a rollback
// to an even older version (the region's security events are replayed on
// top of the rolled-back snapshot).
func TestRolloutStagedRegion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	d := startDist(t)
	c := d.Clients()
	for name, policy := range map[string]adminv1.RolloutPolicy{
		"eu": adminv1.RolloutPolicy_ROLLOUT_POLICY_AUTO, "us": adminv1.RolloutPolicy_ROLLOUT_POLICY_STAGED,
	} {
		_, err := c.Rollout.UpsertRegion(ctx, connect.NewRequest(&adminv1.UpsertRegionRequest{Name: name, Policy: policy}))
		require.NoError(t, err)
	}
	// The publisher creates a region's stream and compiles a version with
	// its position when it sees the region; data planes start after that.
	harness.Eventually(t, func() bool {
		_, regions := rolloutStatus(t, c)
		return regions["eu"].GetRegion().GetCurrentVersion() > 0 && regions["us"].GetRegion().GetCurrentVersion() > 0
	}, 10*time.Second, 20*time.Millisecond, "regions never got a config version")
	ten := d.NewTenant("acme")
	eu, us, def := d.StartProxy("eu", time.Minute), d.StartProxy("us", time.Minute), d.StartProxy("default", time.Minute)
	auto := []*proxy{eu, def}

	// Version N: us runs a version with the tenant (promote it there).
	deadline := time.Now().Add(10 * time.Second)
	for {
		require.True(t, time.Now().Before(deadline), "the staged region never ran the tenant's key")
		st, regions := rolloutStatus(t, c)
		if v := st.GetLatest().GetVersion(); v > regions["us"].GetRegion().GetCurrentVersion() {
			_, err := c.Rollout.PromoteVersion(ctx, connect.NewRequest(&adminv1.PromoteVersionRequest{Region: "us", Version: v}))
			require.NoError(t, err)
		}
		if got, _ := harness.Check(t, us, ten.Token); got == http.StatusOK {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	_, regions := rolloutStatus(t, c)
	n := regions["us"].GetRegion().GetCurrentVersion()
	waitVersion(t, us, n, 2*time.Second)
	for _, p := range auto {
		harness.WaitStatus(t, p, ten.Token, http.StatusOK, 2*time.Second)
	}

	// newKey creates a key for the tenant (not a security event) and
	// returns its token and the version compiled with it, once the auto
	// regions run that version.
	newKey := func() (string, uint64) {
		t.Helper()
		k, err := c.Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: ten.OrgID, TeamId: ten.TeamID, UserId: ten.UserID}))
		require.NoError(t, err)
		for _, p := range auto {
			harness.WaitStatus(t, p, k.Msg.Token, http.StatusOK, time.Second)
		}
		seq := eu.DP.Catalog().EventsSeq // covers the key's event
		var v uint64
		harness.Eventually(t, func() bool {
			st, _ := rolloutStatus(t, c)
			v = st.GetLatest().GetVersion()
			return st.GetLatest().GetEventsSeq() >= seq
		}, 5*time.Second, 20*time.Millisecond, "no version compiled with the new key")
		for _, p := range auto {
			waitVersion(t, p, v, 2*time.Second)
		}
		return k.Msg.Token, v
	}
	unknown := func(p *proxy, tok string) {
		t.Helper()
		got, code := harness.Check(t, p, tok)
		require.Equal(t, http.StatusUnauthorized, got)
		require.Equal(t, "invalid_api_key", code)
	}

	// N+1 goes live in the auto regions only.
	k2, n1 := newKey()
	require.Greater(t, n1, n)
	unknown(us, k2)
	require.Equal(t, n, us.DP.Catalog().Version, "the staged region moved on its own")

	// The rollout status shows which instance runs which version.
	want := map[string]uint64{eu.DP.Config().InstanceID: n1, def.DP.Config().InstanceID: n1, us.DP.Config().InstanceID: n}
	harness.Eventually(t, func() bool {
		st, regions := rolloutStatus(t, c)
		if st.GetLatest().GetVersion() != n1 || regions["eu"].GetRegion().GetCurrentVersion() != n1 ||
			regions["us"].GetRegion().GetCurrentVersion() != n || regions["default"].GetRegion().GetCurrentVersion() != n1 {
			return false
		}
		seen := 0
		for _, r := range regions {
			for _, dp := range r.GetDataPlanes() {
				if v, ok := want[dp.GetInstanceId()]; !ok || v != dp.GetAppliedVersion() || dp.GetHealth() != "ok" {
					return false
				}
				seen++
			}
		}
		return seen == len(want)
	}, 5*time.Second, 20*time.Millisecond, "rollout status does not show eu and default on %d, us on %d", n1, n)

	// Promote: us runs N+1.
	_, err := c.Rollout.PromoteVersion(ctx, connect.NewRequest(&adminv1.PromoteVersionRequest{Region: "us", Version: n1}))
	require.NoError(t, err)
	harness.WaitStatus(t, us, k2, http.StatusOK, 2*time.Second)
	require.Equal(t, n1, us.DP.Catalog().Version)

	// Roll back: us runs N again, through a pointer marked as a rollback
	// (a lower version is refused otherwise).
	_, err = c.Rollout.RollbackRegion(ctx, connect.NewRequest(&adminv1.RollbackRegionRequest{Region: "us", Version: n}))
	require.NoError(t, err)
	waitVersion(t, us, n, 2*time.Second)
	unknown(us, k2)
	got, _ := harness.Check(t, us, ten.Token)
	require.Equal(t, http.StatusOK, got)
	ptr := regionPointer(t, d, "us")
	require.Equal(t, n, ptr.GetVersion())
	require.True(t, ptr.GetRollback(), "a rollback pointer must say so")
	require.Empty(t, us.DP.Rejected())

	// Mid-rollout: us on N+1, the auto regions on N+2.
	_, err = c.Rollout.PromoteVersion(ctx, connect.NewRequest(&adminv1.PromoteVersionRequest{Region: "us", Version: n1}))
	require.NoError(t, err)
	waitVersion(t, us, n1, 2*time.Second)
	require.False(t, regionPointer(t, d, "us").GetRollback())
	k3, n2 := newKey()
	require.Greater(t, n2, n1)
	unknown(us, k3)

	// A block is a security event: it reaches the staged region at once,
	// without a new version there.
	blocked := time.Now()
	_, err = c.Key.BlockKey(ctx, connect.NewRequest(&adminv1.BlockKeyRequest{Id: ten.KeyID}))
	require.NoError(t, err)
	for _, p := range []*proxy{us, eu, def} {
		harness.WaitStatus(t, p, ten.Token, http.StatusForbidden, time.Second)
		_, code := harness.Check(t, p, ten.Token)
		require.Equal(t, "key_blocked", code)
	}
	t.Logf("block enforced on every region within %s (us still on version %d)", time.Since(blocked), us.DP.Catalog().Version)
	require.Equal(t, n1, us.DP.Catalog().Version)

	// Promoting to a version older than the current one is refused.
	_, err = c.Rollout.PromoteVersion(ctx, connect.NewRequest(&adminv1.PromoteVersionRequest{Region: "us", Version: n}))
	require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err), "%v", err)

	// Roll back to N, older than the block: the block is replayed on top
	// of the snapshot, and the key never answers 200 on the way.
	regionSeq := us.DP.Catalog().RegionSeq
	_, err = c.Rollout.RollbackRegion(ctx, connect.NewRequest(&adminv1.RollbackRegionRequest{Region: "us", Version: n}))
	require.NoError(t, err)
	deadline = time.Now().Add(2 * time.Second)
	for us.DP.Catalog().Version != n {
		require.True(t, time.Now().Before(deadline), "us never rolled back to %d", n)
		got, code := harness.Check(t, us, ten.Token)
		require.Equal(t, http.StatusForbidden, got, code)
		time.Sleep(5 * time.Millisecond)
	}
	got, code := harness.Check(t, us, ten.Token)
	require.Equal(t, http.StatusForbidden, got)
	require.Equal(t, "key_blocked", code)
	unknown(us, k2)
	unknown(us, k3)
	require.Empty(t, us.DP.Rejected())
	ptr = regionPointer(t, d, "us")
	require.True(t, ptr.GetRollback())
	require.Less(t, ptr.GetRegionSeq(), regionSeq, "version %d predates the block in us's stream", n)
	require.Equal(t, regionSeq, us.DP.Catalog().RegionSeq, "the rolled-back catalog replays the region's events")
	t.Logf("versions: N=%d N+1=%d N+2=%d; us rolled back to %d (region_seq %d) and replayed up to region_seq %d",
		n, n1, n2, n, ptr.GetRegionSeq(), regionSeq)
}

// regionPointer reads region's snapshot pointer from the KV bucket.
func regionPointer(t testing.TB, d *dist, region string) *configv1.SnapshotPointer {
	t.Helper()
	nc, err := nats.Connect(d.NATS.URL)
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	kv, err := js.KeyValue(ctx, wire.PointerBucket)
	require.NoError(t, err)
	e, err := kv.Get(ctx, wire.PointerKey(region))
	require.NoError(t, err)
	ptr := &configv1.SnapshotPointer{}
	require.NoError(t, proto.Unmarshal(e.Value(), ptr))
	return ptr
}
