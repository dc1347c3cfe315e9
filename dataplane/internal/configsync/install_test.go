package configsync

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// grantsCatalog builds the catalog of snapshot version holding events up
// to eventsSeq at region position regionSeq: org a, and the model group
// "granted" granted to the orgs given.
func grantsCatalog(t *testing.T, version, eventsSeq, regionSeq uint64, granted ...string) *catalog.Catalog {
	t.Helper()
	c, err := catalog.FromSnapshot(&configv1.Snapshot{SchemaVersion: wire.SchemaVersion, Version: version, EventsSeq: eventsSeq,
		Orgs:        []*configv1.Org{{Id: "a"}},
		ModelGroups: []*configv1.ModelGroup{{Name: "granted", GrantedOrgIds: granted}}}, regionSeq, nil)
	require.NoError(t, err)
	return c
}

// groupEvent is the state-carrying event of the model group "granted"
// (granted to the orgs given) at regionSeq, outbox seq seq.
func groupEvent(regionSeq, seq uint64, kind string, granted ...string) *configv1.RegionEvent {
	return &configv1.RegionEvent{Region: region, RegionSeq: regionSeq, Event: &configv1.Event{Seq: seq, Kind: kind,
		Security: kind == "model_group.revoked",
		Change:   &configv1.Event_ModelGroup{ModelGroup: &configv1.ModelGroup{Name: "granted", GrantedOrgIds: granted}}}}
}

// TestSnapshotLoadedDuringRevocation is the ordering behind the flaky
// e2e TestModelGroupGrants (a revoked grant served again): the leader
// compiles snapshot 2 before RevokeModelGroup commits, writes its pointer,
// then appends the revocation. The data plane's pointer watch starts
// loading snapshot 2 (the running catalog, version 1, is what it compares
// it with); while it fetches and decodes, the event consumer applies the
// revocation to the running catalog and requests are refused. Snapshot 2
// sits at the same stream position as the catalog load compared it with,
// so it needed no catch-up then; swapping it in as it is would restore the
// grant until the next consumer re-applied the revocation. The swap must
// catch it up to the catalog actually running: the revocation stays.
func TestSnapshotLoadedDuringRevocation(t *testing.T) {
	t.Parallel()
	b := newBus(t)
	grant, revoke := groupEvent(1, 7, "model_group.granted", "a"), groupEvent(2, 8, "model_group.revoked")
	b.event(grant)
	b.event(revoke)
	s, err := New(Config{Region: region, InstanceID: "dp-test"}, b.nc)
	require.NoError(t, err)
	ctx := context.Background()

	// Running: snapshot 1 at the grant, its consumer at generation 0.
	s.cat.Store(grantsCatalog(t, 1, 7, 1, "a"))
	gen := s.gen
	// The pointer to snapshot 2 arrives: load compares it with the running
	// catalog (seen) and builds it.
	seen := s.Catalog()
	next := grantsCatalog(t, 2, 7, 1, "a")
	// Meanwhile the consumer applies the revocation.
	applied, err := s.apply(gen, revoke)
	require.NoError(t, err)
	require.True(t, applied)
	require.False(t, s.Catalog().ModelGroupVisible("a", "granted"), "the consumer applied the revocation")

	_, err = s.install(ctx, false, next, seen)
	require.NoError(t, err)
	c := s.Catalog()
	require.EqualValues(t, 2, c.Version, "snapshot 2 runs")
	require.False(t, c.ModelGroupVisible("a", "granted"), "a snapshot compiled before the revocation must not restore the grant")
	require.Equal(t, [2]uint64{8, 2}, [2]uint64{c.EventsSeq, c.RegionSeq}, "caught up to the revocation")

	// The old consumer stops at its next message: the new generation's
	// consumer starts after the revocation (region_seq 3).
	applied, err = s.apply(gen, groupEvent(3, 9, "model_group.granted", "a"))
	require.NoError(t, err)
	require.False(t, applied, "a consumer of the replaced catalog applies nothing more")
	require.False(t, s.Catalog().ModelGroupVisible("a", "granted"))
}

// TestSnapshotInstalledWithoutCatchUp: when nothing was applied while a
// snapshot loaded, a snapshot holding every event the running catalog
// applied is swapped in as compiled (no stream read; the consumer then
// skips the events it holds), and a rollback is caught up from the stream.
func TestSnapshotInstalledWithoutCatchUp(t *testing.T) {
	t.Parallel()
	b := newBus(t)
	revoke := groupEvent(2, 8, "model_group.revoked")
	b.event(groupEvent(1, 7, "model_group.granted", "a"))
	b.event(revoke)
	s, err := New(Config{Region: region, InstanceID: "dp-test"}, b.nc)
	require.NoError(t, err)
	ctx := context.Background()

	// Running at the revocation; snapshot 2 was compiled after it (it
	// holds event 8) at an older stream position: no catch-up.
	s.cat.Store(grantsCatalog(t, 1, 8, 2))
	newer := grantsCatalog(t, 2, 8, 1)
	installed, err := s.install(ctx, false, newer, s.Catalog())
	require.NoError(t, err)
	require.Same(t, newer, installed)
	require.Same(t, newer, s.Catalog())
	applied, err := s.apply(s.gen, revoke)
	require.NoError(t, err)
	require.True(t, applied)
	require.EqualValues(t, 2, s.Catalog().RegionSeq, "the revocation is held by snapshot 2: skipped")
	require.False(t, s.Catalog().ModelGroupVisible("a", "granted"))

	// A rollback to snapshot 1, compiled before the revocation: caught up
	// from the stream, the revocation applies again.
	installed, err = s.install(ctx, true, grantsCatalog(t, 1, 7, 1, "a"), s.Catalog())
	require.NoError(t, err)
	require.Same(t, installed, s.Catalog())
	require.EqualValues(t, 1, installed.Version)
	require.False(t, installed.ModelGroupVisible("a", "granted"))
	require.Equal(t, [2]uint64{8, 2}, [2]uint64{installed.EventsSeq, installed.RegionSeq})
	require.EqualValues(t, 2, s.gen, "each swap starts a consumer generation")
}
