package system

import (
	"context"
	"io"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/sluicegw/sluice/dataplane"

	"github.com/sluicegw/sluice/e2e/harness"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/internal/testsvc"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// readyz returns /readyz's status and body.
func readyz(t testing.TB, p *proxy) (int, string) {
	t.Helper()
	resp, err := http.Get(p.URL + "/readyz")
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

// fleetEntry returns p's entry in the fleet view (nil if absent).
func (d *dist) fleetEntry(t testing.TB, p *proxy) *adminv1.DataPlane {
	t.Helper()
	resp, err := d.Clients().Fleet.ListDataPlanes(context.Background(), connect.NewRequest(&adminv1.ListDataPlanesRequest{}))
	require.NoError(t, err)
	for _, dp := range resp.Msg.DataPlanes {
		if dp.InstanceId == p.DP.Config().InstanceID {
			return dp
		}
	}
	return nil
}

// TestRejectingIsReported: a data plane whose region pointer names an
// older snapshot than it runs (what a control plane that lost its history
// used to publish) keeps serving its snapshot, and says so: at once in
// its metrics and heartbeat, and past --max-rejecting in its health
// ("rejecting"), the fleet view and /readyz (503). A pointer it accepts
// ends it.
func TestRejectingIsReported(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	_, js := d.js(t)
	ctx := context.Background()
	older := d.waitPointer(t, 1)
	ten := d.NewTenant("rejecting")
	d.waitPublished(t, 10*time.Second)
	head := d.outboxHead(t)
	harness.Eventually(t, func() bool {
		ptr, _ := d.pointer(t, js)
		return ptr != nil && ptr.GetEventsSeq() == head && ptr.GetVersion() > older.GetVersion()
	}, 10*time.Second, 10*time.Millisecond, "no snapshot with the tenant")
	const bound = 1500 * time.Millisecond
	p := d.StartProxy(testRegion, time.Minute, func(c *dataplane.Config) { c.MaxRejecting = bound })
	harness.Eventually(t, func() bool {
		ptr, _ := d.pointer(t, js)
		return p.DP.Catalog().Version == ptr.GetVersion()
	}, 10*time.Second, 10*time.Millisecond)
	running := p.DP.Catalog().Version
	harness.WaitStatus(t, p, ten.Token, http.StatusOK, 5*time.Second)
	code, _ := readyz(t, p)
	require.Equal(t, http.StatusOK, code)
	require.Zero(t, llMetric(t, p, "sluice_dataplane_rejecting_seconds"))

	kv, err := js.KeyValue(ctx, wire.PointerBucket)
	require.NoError(t, err)
	olderBytes, err := proto.Marshal(older)
	require.NoError(t, err)
	_, err = kv.Put(ctx, wire.PointerKey(testRegion), olderBytes)
	require.NoError(t, err)
	start := time.Now()

	// At once: the refusal is reported, the instance is still ready.
	harness.Eventually(t, func() bool { return p.DP.Rejecting() != nil }, 5*time.Second, 10*time.Millisecond)
	r := p.DP.Rejecting()
	require.Equal(t, older.GetVersion(), r.GetVersion())
	require.Equal(t, running, r.GetRunningVersion())
	require.Contains(t, r.GetReason(), "lower than the running")
	if time.Since(start) < bound-200*time.Millisecond {
		require.False(t, r.GetPastBound())
		code, _ := readyz(t, p)
		require.Equal(t, http.StatusOK, code, "ready until the bound")
	}

	// Past the bound: readyz fails naming the mismatch; requests are still
	// served from the last good snapshot.
	var body string
	harness.Eventually(t, func() bool {
		code, body = readyz(t, p)
		return code == http.StatusServiceUnavailable
	}, 10*time.Second, 10*time.Millisecond, "/readyz never failed")
	require.GreaterOrEqual(t, time.Since(start), bound)
	require.Contains(t, body, "rejecting control plane: version "+u64(older.GetVersion())+" < running "+u64(running))
	require.EqualValues(t, 1, llMetric(t, p, "sluice_dataplane_rejecting"))
	require.GreaterOrEqual(t, llMetric(t, p, "sluice_dataplane_rejecting_seconds"), int64(1))
	require.Positive(t, llMetric(t, p, "sluice_dataplane_snapshots_rejected_total"))
	harness.WaitStatus(t, p, ten.Token, http.StatusOK, time.Second)
	require.Equal(t, running, p.DP.Catalog().Version)

	// The heartbeat carries it to the fleet view.
	var view *adminv1.DataPlane
	harness.Eventually(t, func() bool {
		view = d.fleetEntry(t, p)
		return view != nil && view.GetRejecting().GetPastBound() && view.GetHealth() == "rejecting"
	}, 10*time.Second, 10*time.Millisecond, "the fleet view does not show the instance rejecting")
	require.Equal(t, older.GetVersion(), view.GetRejecting().GetVersion())
	require.Equal(t, running, view.GetRejecting().GetRunningVersion())
	require.NotNil(t, view.GetRejecting().GetSince())

	// A newer snapshot ends it everywhere.
	_, err = d.Clients().Key.BlockKey(ctx, connect.NewRequest(&adminv1.BlockKeyRequest{Id: ten.KeyID}))
	require.NoError(t, err)
	harness.WaitStatus(t, p, ten.Token, http.StatusForbidden, 2*time.Second)
	harness.Eventually(t, func() bool { return p.DP.Catalog().Version > running }, 10*time.Second, 10*time.Millisecond, "no newer snapshot applied")
	require.Nil(t, p.DP.Rejecting())
	code, _ = readyz(t, p)
	require.Equal(t, http.StatusOK, code)
	require.Zero(t, llMetric(t, p, "sluice_dataplane_rejecting"))
	harness.Eventually(t, func() bool {
		view = d.fleetEntry(t, p)
		return view != nil && view.GetRejecting() == nil && view.GetHealth() == "ok"
	}, 10*time.Second, 10*time.Millisecond, "the fleet view still shows the instance rejecting")
}

func u64(v uint64) string { return strconv.FormatUint(v, 10) }

// switchRig is a fleet run by a control plane on database A: two data
// planes in the default (auto) region and one in a staged region, and
// tenants created before and after a backup of A.
type switchRig struct {
	d        *dist
	proxies  []*proxy
	before   tenant // exists in the backup
	after    tenant // created after the backup
	blocked  tenant // in the backup; its key blocked after it
	lastA    uint64 // A's last snapshot version
	backupDB string
	// backupNATS is a copy of NATS's JetStream store taken with the
	// database's backup (newSwitchRig with natsToo).
	backupNATS string
}

func newSwitchRig(t *testing.T, natsToo bool) *switchRig {
	t.Helper()
	ctx := context.Background()
	d := startDist(t)
	c := d.Clients()
	_, err := c.Rollout.UpsertRegion(ctx, connect.NewRequest(&adminv1.UpsertRegionRequest{Name: "canary", Policy: adminv1.RolloutPolicy_ROLLOUT_POLICY_STAGED}))
	require.NoError(t, err)
	harness.Eventually(t, func() bool {
		_, regions := rolloutStatus(t, c)
		return regions["canary"].GetRegion().GetCurrentVersion() > 0
	}, 10*time.Second, 20*time.Millisecond, "the staged region never got a version")
	r := &switchRig{d: d, before: d.NewTenant("before"), blocked: d.NewTenant("blocked-later")}
	r.proxies = []*proxy{d.StartProxy(testRegion, time.Minute), d.StartProxy(testRegion, time.Minute), d.StartProxy("canary", time.Minute)}
	d.waitPublished(t, 10*time.Second)
	// The staged region runs the tenants' version too.
	r.promoteLatest(t)
	for _, p := range r.proxies {
		harness.WaitStatus(t, p, r.before.Token, http.StatusOK, 10*time.Second)
	}

	// The backup (pg_dump while the control plane runs), then more work.
	r.backupDB = testsvc.BackupRestore(t, d.DatabaseURL)
	if natsToo {
		d.NATS.Stop()
		r.backupNATS = d.NATS.Backup()
		d.NATS.Start()
	}
	r.after = d.NewTenant("after")
	_, err = c.Key.BlockKey(ctx, connect.NewRequest(&adminv1.BlockKeyRequest{Id: r.blocked.KeyID}))
	require.NoError(t, err)
	auto := r.proxies[:2]
	for _, p := range auto {
		harness.WaitStatus(t, p, r.after.Token, http.StatusOK, 10*time.Second)
	}
	for _, p := range r.proxies {
		harness.WaitStatus(t, p, r.blocked.Token, http.StatusForbidden, 2*time.Second)
	}
	// Let A compile its last snapshot, and every data plane run it.
	d.waitPublished(t, 10*time.Second)
	head := d.outboxHead(t)
	harness.Eventually(t, func() bool {
		st, _ := rolloutStatus(t, c)
		r.lastA = st.GetLatest().GetVersion()
		return st.GetLatest().GetEventsSeq() == head
	}, 10*time.Second, 10*time.Millisecond)
	for _, p := range auto {
		waitVersion(t, p, r.lastA, 5*time.Second)
	}
	return r
}

// promoteLatest waits for a version holding the last change and promotes
// it in the staged region.
func (r *switchRig) promoteLatest(t *testing.T) {
	t.Helper()
	c := r.d.Clients()
	harness.Eventually(t, func() bool {
		st, _ := rolloutStatus(t, c)
		if st.GetLatest().GetEventsSeq() < r.d.outboxHead(t) {
			return false
		}
		_, err := c.Rollout.PromoteVersion(context.Background(), connect.NewRequest(&adminv1.PromoteVersionRequest{Region: "canary", Version: st.GetLatest().GetVersion()}))
		return err == nil
	}, 10*time.Second, 20*time.Millisecond, "no version holding the last change to promote")
}

// switchTo stops A's control plane and starts one on dbURL (the test's
// database from now on). It returns when the new control plane serves.
func (r *switchRig) switchTo(t *testing.T, dbURL string) time.Time {
	t.Helper()
	for _, stop := range r.d.Controls {
		stop()
	}
	r.d.DatabaseURL = dbURL
	r.d.Admin = r.d.startControlDB("cp-new", dbURL)
	return time.Now()
}

// converged waits, up to 5 s after start, until every data plane runs a
// version above A's last one holding the new database's last change, then
// checks each against a fresh snapshot of the new database.
func (r *switchRig) converged(t *testing.T, start time.Time) {
	t.Helper()
	deadline := start.Add(5 * time.Second)
	for i, p := range r.proxies {
		for {
			c := p.DP.Catalog()
			if c.Version > r.lastA && c.EventsSeq == r.d.outboxHead(t) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("data plane %d (region %s) has not converged 5 s after the switch: version %d (A's last %d), events_seq %d, outbox head %d, rejecting %v",
					i, p.DP.Config().Region, c.Version, r.lastA, c.EventsSeq, r.d.outboxHead(t), p.DP.Rejecting())
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	t.Logf("every data plane converged %s after the new control plane started", time.Since(start).Round(time.Millisecond))
	for i, p := range r.proxies {
		if r.backupNATS == "" {
			// With NATS restored, the restored pointer (older than what
			// runs) is refused once, before the epoch's.
			require.Zero(t, p.DP.SyncStats().SnapshotsRejected, "data plane %d refused a snapshot", i)
		}
		require.Nil(t, p.DP.Rejecting(), "data plane %d", i)
	}
}

// afterwards: a tenant created on the new control plane authenticates
// everywhere, and a block is enforced within the usual bound.
func (r *switchRig) afterwards(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	fresh := r.d.NewTenant("fresh")
	for _, p := range r.proxies[:2] {
		harness.WaitStatus(t, p, fresh.Token, http.StatusOK, 2*time.Second)
	}
	// The staged region gets creations with a promoted version.
	c := r.d.Clients()
	r.promoteLatest(t)
	harness.WaitStatus(t, r.proxies[2], fresh.Token, http.StatusOK, 5*time.Second)

	blockedAt := time.Now()
	_, err := c.User.BlockUser(ctx, connect.NewRequest(&adminv1.BlockUserRequest{Id: fresh.UserID}))
	require.NoError(t, err)
	for _, p := range r.proxies {
		harness.WaitStatus(t, p, fresh.Token, http.StatusForbidden, time.Second)
		_, code := harness.Check(t, p, fresh.Token)
		require.Equal(t, "user_blocked", code)
	}
	t.Logf("block enforced on every data plane %s after the call", time.Since(blockedAt).Round(time.Millisecond))
	cats := r.d.waitCaughtUp(t, 5*time.Second, r.proxies[:2]...)
	r.d.requireEqualsFresh(t, cats)
}

// TestSwitchToRestoredBackup: the control plane is switched from database
// A to a backup of A taken earlier, NATS keeping what A published. The
// fleet converges on the backup's state (with the block issued after the
// backup re-applied), new keys and blocks work, and versions of the
// abandoned history can no longer be rolled back to.
func TestSwitchToRestoredBackup(t *testing.T) {
	t.Parallel()
	r := newSwitchRig(t, false)
	start := r.switchTo(t, r.backupDB)
	r.converged(t, start)
	for _, p := range r.proxies {
		got, code := harness.Check(t, p, r.after.Token)
		require.Equal(t, http.StatusUnauthorized, got, "a key created after the backup is not in the restored database")
		require.Equal(t, "invalid_api_key", code)
		got, code = harness.Check(t, p, r.blocked.Token)
		require.Equal(t, http.StatusForbidden, got, "the block issued after the backup is re-applied")
		require.Equal(t, "key_blocked", code)
		harness.WaitStatus(t, p, r.before.Token, http.StatusOK, time.Second)
	}
	ctx := context.Background()
	st, _ := rolloutStatus(t, r.d.Clients())
	ep := st.GetEpoch()
	require.NotNil(t, ep, "the rollout status shows the epoch")
	require.EqualValues(t, 1, ep.GetEpoch())
	require.Equal(t, r.lastA, ep.GetVersionFloor())
	require.Len(t, ep.GetReapplied(), 1)
	require.Contains(t, ep.GetReapplied()[0], r.blocked.KeyID)
	_, err := r.d.Clients().Rollout.RollbackRegion(ctx, connect.NewRequest(&adminv1.RollbackRegionRequest{Region: "canary", Version: 1}))
	require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err))
	require.Contains(t, err.Error(), "predates distribution epoch 1")
	r.afterwards(t)
}

// TestSwitchToEmptyDatabase: the same with an empty database B.
func TestSwitchToEmptyDatabase(t *testing.T) {
	t.Parallel()
	r := newSwitchRig(t, false)
	start := r.switchTo(t, testsvc.NewDatabase(t))
	// B does not know the staged region: the operator creates it again.
	_, err := r.d.Clients().Rollout.UpsertRegion(context.Background(), connect.NewRequest(&adminv1.UpsertRegionRequest{
		Name: "canary", Policy: adminv1.RolloutPolicy_ROLLOUT_POLICY_STAGED}))
	require.NoError(t, err)
	r.converged(t, start)
	for _, p := range r.proxies {
		for _, tok := range []string{r.before.Token, r.after.Token, r.blocked.Token} {
			got, code := harness.Check(t, p, tok)
			require.Equal(t, http.StatusUnauthorized, got, "database B has no keys")
			require.Equal(t, "invalid_api_key", code)
		}
	}
	r.afterwards(t)
}

// TestRestoreBothFromBackups: Postgres and NATS are both restored from
// backups taken at the same moment while the data planes keep running
// what was published after it. JetStream agrees with the database, so
// only the data planes' heartbeats show the fleet ahead: the control plane
// starts an epoch above what they run and the fleet follows. The block
// issued after the backups is in neither, so it is lost: the key
// authenticates again (docs/distribution.md: re-issue such revocations).
func TestRestoreBothFromBackups(t *testing.T) {
	t.Parallel()
	r := newSwitchRig(t, true)
	for _, stop := range r.d.Controls {
		stop()
	}
	r.d.NATS.Stop()
	r.d.NATS.RestoreBackup(r.backupNATS)
	r.d.NATS.Start()
	start := r.switchTo(t, r.backupDB)
	r.converged(t, start)
	for _, p := range r.proxies {
		got, _ := harness.Check(t, p, r.after.Token)
		require.Equal(t, http.StatusUnauthorized, got, "a key created after the backups does not exist")
		harness.WaitStatus(t, p, r.blocked.Token, http.StatusOK, time.Second)
		harness.WaitStatus(t, p, r.before.Token, http.StatusOK, time.Second)
	}
	st, _ := rolloutStatus(t, r.d.Clients())
	require.NotNil(t, st.GetEpoch())
	require.Contains(t, st.GetEpoch().GetReason(), "data plane")
	require.GreaterOrEqual(t, st.GetEpoch().GetVersionFloor(), r.lastA)
	r.afterwards(t)
}
