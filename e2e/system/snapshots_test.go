package system

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sluicegw/sluice/e2e/harness"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// TestBadSnapshotsAreRejected writes bad pointers to the region's KV entry
// by hand (what a corrupted store, a buggy or stale publisher, or an
// attacker with write access to the bucket would leave there): a data
// plane never applies them, keeps serving from the last good snapshot,
// records each one with a reason and reports them in the fleet view.
func TestBadSnapshotsAreRejected(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	_, js := d.js(t)
	ctx := context.Background()
	c := d.Clients()

	older := d.waitPointer(t, 1)
	olderBytes, err := proto.Marshal(older)
	require.NoError(t, err)
	ten := d.NewTenant("bad-snapshots")
	d.waitPublished(t, 10*time.Second)
	// The snapshot that holds ten (a later version than older).
	var good *configv1.SnapshotPointer
	head := d.outboxHead(t)
	harness.Eventually(t, func() bool {
		good, _ = d.pointer(t, js)
		return good != nil && good.GetEventsSeq() == head
	}, 10*time.Second, 10*time.Millisecond)
	require.Greater(t, good.GetVersion(), older.GetVersion())

	p := d.StartProxy(testRegion, time.Minute)
	// A later compile may still land; settle on whatever the proxy and the
	// pointer agree on.
	harness.Eventually(t, func() bool {
		cur, _ := d.pointer(t, js)
		if cur == nil || p.DP.Catalog().Version != cur.GetVersion() {
			return false
		}
		good = cur
		return true
	}, 10*time.Second, 10*time.Millisecond)
	harness.WaitStatus(t, p, ten.Token, http.StatusOK, 5*time.Second)

	kv, err := js.KeyValue(ctx, wire.PointerBucket)
	require.NoError(t, err)
	obs, err := js.ObjectStore(ctx, wire.SnapshotBucket)
	require.NoError(t, err)
	junk := []byte("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff not a snapshot")
	_, err = obs.PutBytes(ctx, "snapshot-junk", junk)
	require.NoError(t, err)
	put := func(ptr *configv1.SnapshotPointer) []byte {
		b, err := proto.Marshal(ptr)
		require.NoError(t, err)
		return b
	}
	n := good.GetVersion()
	cases := []struct {
		name    string
		value   []byte
		version uint64 // recorded in the rejection
		reason  string
	}{
		{"wrong digest", put(&configv1.SnapshotPointer{Version: n + 100, Digest: wire.Digest([]byte("something else")),
			EventsSeq: good.GetEventsSeq(), RegionSeq: good.GetRegionSeq(), Object: good.GetObject()}),
			n + 100, wire.ErrDigest.Error()},
		{"lower version", olderBytes, older.GetVersion(), "lower than the running"},
		{"undecodable body", put(&configv1.SnapshotPointer{Version: n + 200, Digest: wire.Digest(junk),
			EventsSeq: good.GetEventsSeq(), RegionSeq: good.GetRegionSeq(), Object: "snapshot-junk"}),
			n + 200, "does not decode"},
		{"undecodable pointer", []byte("\xff\xff\xff\xff"), 0, "pointer does not decode"},
	}
	for i, tc := range cases {
		_, err := kv.Put(ctx, wire.PointerKey(testRegion), tc.value)
		require.NoError(t, err, tc.name)
		var rej []*configv1.RejectedSnapshot
		harness.Eventually(t, func() bool {
			rej = p.DP.Rejected()
			return len(rej) == i+1
		}, 5*time.Second, 10*time.Millisecond, "%s: not rejected", tc.name)
		last := rej[i]
		require.Equal(t, tc.version, last.GetVersion(), tc.name)
		require.Contains(t, last.GetReason(), tc.reason, tc.name)
		require.NotNil(t, last.GetAt(), tc.name)
		// The last good snapshot stays and keeps answering.
		cat := p.DP.Catalog()
		require.Equal(t, n, cat.Version, tc.name)
		got, _ := harness.Check(t, p, ten.Token)
		require.Equal(t, http.StatusOK, got, tc.name)
		got, code := harness.Check(t, p, "sk-sluice-not-a-real-token")
		require.Equal(t, http.StatusUnauthorized, got, tc.name)
		require.Equal(t, "invalid_api_key", code, tc.name)
		require.True(t, p.DP.Ready(), tc.name)
	}
	st := p.DP.SyncStats()
	require.EqualValues(t, len(cases), st.SnapshotsRejected)
	require.EqualValues(t, 1, st.SnapshotsApplied)

	// The fleet view shows the instance's rejected snapshots.
	var view *adminv1.DataPlane
	harness.Eventually(t, func() bool {
		resp, err := c.Fleet.ListDataPlanes(ctx, connect.NewRequest(&adminv1.ListDataPlanesRequest{Region: testRegion}))
		if err != nil {
			return false
		}
		for _, dp := range resp.Msg.DataPlanes {
			if dp.InstanceId == p.DP.Config().InstanceID {
				view = dp
			}
		}
		return view != nil && len(view.RejectedSnapshots) == len(cases)
	}, 5*time.Second, 10*time.Millisecond, "the fleet view does not list the rejected snapshots")
	require.Equal(t, n, view.AppliedVersion)
	for i, tc := range cases {
		r := view.RejectedSnapshots[i]
		require.Equal(t, tc.version, r.Version, tc.name)
		require.True(t, strings.Contains(r.Reason, tc.reason), "%s: reason %q", tc.name, r.Reason)
		require.NotNil(t, r.Time, tc.name)
	}

	// Events still flow, and the next good version is applied normally.
	_, err = c.Key.BlockKey(ctx, connect.NewRequest(&adminv1.BlockKeyRequest{Id: ten.KeyID}))
	require.NoError(t, err)
	harness.WaitStatus(t, p, ten.Token, http.StatusForbidden, time.Second)
	harness.Eventually(t, func() bool { return p.DP.Catalog().Version > n }, 10*time.Second, 10*time.Millisecond, "the next good snapshot was not applied")
	next, _ := d.pointer(t, js)
	require.Equal(t, next.GetVersion(), p.DP.Catalog().Version)
	require.EqualValues(t, 2, p.DP.SyncStats().SnapshotsApplied)
	require.Len(t, p.DP.Rejected(), len(cases), "nothing else rejected")
	_, code := harness.Check(t, p, ten.Token)
	require.Equal(t, "key_blocked", code)
}
