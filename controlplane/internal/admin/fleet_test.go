package admin

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	eventkinds "github.com/sluicegw/sluice/controlplane/internal/events"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
	"github.com/sluicegw/sluice/proto/wire"
)

// fleetClients are the fleet and rollout clients for one token.
type fleetClients struct {
	Fleet   adminv1connect.FleetServiceClient
	Rollout adminv1connect.RolloutServiceClient
}

func (b *bundle) fleetAs(tok string) fleetClients {
	opt := connect.WithInterceptors(bearer(tok))
	return fleetClients{
		Fleet:   adminv1connect.NewFleetServiceClient(http.DefaultClient, b.url, opt),
		Rollout: adminv1connect.NewRolloutServiceClient(http.DefaultClient, b.url, opt),
	}
}

// digestOf is the fake digest of test config version v.
func digestOf(v uint64) []byte {
	var buf [8]byte
	binary.BigEndian.PutUint64(buf[:], v)
	d := sha256.Sum256(buf[:])
	return d[:]
}

// mkConfigVersion inserts compiled config version v (as the publisher
// would) with a stream position for each of regions. Inserting an
// existing version again is a no-op.
func (b *bundle) mkConfigVersion(v uint64, regions ...string) {
	b.t.Helper()
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `INSERT INTO config_versions (version, events_seq, digest, size_bytes, object, created_at)
		VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (version) DO NOTHING`,
		int64(v), int64(v*10), digestOf(v), int64(1000+v), wire.SnapshotObject(v), b.clock.Now())
	require.NoError(b.t, err)
	for _, r := range regions {
		_, err := b.pool.Exec(ctx, `INSERT INTO config_version_regions (version, region, region_seq)
			VALUES ($1, $2, $3) ON CONFLICT DO NOTHING`, int64(v), r, int64(v*100))
		require.NoError(b.t, err)
	}
}

// requireProtoEqual requires want and got to be equal messages and shows
// both as JSON when they are not.
func requireProtoEqual(t *testing.T, want, got proto.Message) {
	t.Helper()
	if !proto.Equal(want, got) {
		t.Fatalf("messages differ:\nwant %s\n got %s", protojson.Format(want), protojson.Format(got))
	}
}

// outboxRow is one outbox row as the publisher reads it.
type outboxRow struct {
	Kind, OrgID, ObjectType, ObjectID, Payload string
}

func (b *bundle) outboxCount() int64 {
	b.t.Helper()
	var n int64
	require.NoError(b.t, b.pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox`).Scan(&n))
	return n
}

func (b *bundle) lastOutbox() outboxRow {
	b.t.Helper()
	var r outboxRow
	require.NoError(b.t, b.pool.QueryRow(context.Background(),
		`SELECT kind, org_id, object_type, object_id, payload::text FROM outbox ORDER BY seq DESC LIMIT 1`).
		Scan(&r.Kind, &r.OrgID, &r.ObjectType, &r.ObjectID, &r.Payload))
	return r
}

// auditRow is the part of an audit record the rollout tests check.
type auditRow struct {
	Action, ObjectType, ObjectID, OrgID, Before, After string
}

func (b *bundle) lastAudit() auditRow {
	b.t.Helper()
	var r auditRow
	require.NoError(b.t, b.pool.QueryRow(context.Background(),
		`SELECT action, object_type, object_id, org_id, before_json, after_json FROM audit_log ORDER BY seq DESC LIMIT 1`).
		Scan(&r.Action, &r.ObjectType, &r.ObjectID, &r.OrgID, &r.Before, &r.After))
	return r
}

// regionRow reads a region's pointer fields straight from the table.
func (b *bundle) regionRow(name string) (current int64, rollback bool) {
	b.t.Helper()
	require.NoError(b.t, b.pool.QueryRow(context.Background(),
		`SELECT current_version, rollback FROM regions WHERE name = $1`, name).Scan(&current, &rollback))
	return current, rollback
}

// requireOneChange runs call and requires it to succeed with exactly one
// audit row (action on region name, no tenant) and one region.pointer
// outbox row for name.
func requireOneChange(t *testing.T, b *bundle, action, name string, call func() error) {
	t.Helper()
	audits, events := b.auditCount(), b.outboxCount()
	require.NoError(t, call())
	require.Equal(t, audits+1, b.auditCount(), "exactly one audit row")
	require.Equal(t, events+1, b.outboxCount(), "exactly one outbox row")
	a := b.lastAudit()
	require.Equal(t, action, a.Action)
	require.Equal(t, "region", a.ObjectType)
	require.Equal(t, name, a.ObjectID)
	require.Equal(t, "", a.OrgID)
	ev := b.lastOutbox()
	require.Equal(t, outboxRow{Kind: string(eventkinds.RegionPointer), ObjectType: "region", ObjectID: name,
		Payload: `{"region": "` + name + `"}`}, ev)
}

// requireNoChange runs call and requires it to fail with code, naming
// each of words in the message, without audit or outbox rows.
func requireNoChange(t *testing.T, b *bundle, code string, call func() error, words ...string) {
	t.Helper()
	audits, events := b.auditCount(), b.outboxCount()
	err := call()
	require.Equal(t, code, codeOf(err), "%v", err)
	for _, w := range words {
		require.Contains(t, err.Error(), w)
	}
	require.Equal(t, audits, b.auditCount(), "a refused call writes no audit row")
	require.Equal(t, events, b.outboxCount(), "a refused call writes no outbox row")
}

func TestUpsertRegion(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	c := b.fleetAs(b.bootstrap).Rollout
	upsert := func(name string, p adminv1.RolloutPolicy) func() error {
		return func() error {
			_, err := c.UpsertRegion(ctx, connect.NewRequest(&adminv1.UpsertRegionRequest{Name: name, Policy: p}))
			return err
		}
	}

	requireOneChange(t, b, "created", "eu-west-1", upsert("eu-west-1", adminv1.RolloutPolicy_ROLLOUT_POLICY_STAGED))
	require.Empty(t, b.lastAudit().Before, "a created region has no before value")
	require.Contains(t, b.lastAudit().After, `"policy":"ROLLOUT_POLICY_STAGED"`)

	b.clock.Advance(time.Second)
	var got *adminv1.Region
	requireOneChange(t, b, "updated", "eu-west-1", func() error {
		resp, err := c.UpsertRegion(ctx, connect.NewRequest(&adminv1.UpsertRegionRequest{Name: "eu-west-1", Policy: adminv1.RolloutPolicy_ROLLOUT_POLICY_AUTO}))
		if err == nil {
			got = resp.Msg.Region
		}
		return err
	})
	requireProtoEqual(t, &adminv1.Region{Name: "eu-west-1", Policy: adminv1.RolloutPolicy_ROLLOUT_POLICY_AUTO,
		UpdateTime: timestamppb.New(b.clock.Now())}, got)
	a := b.lastAudit()
	require.Contains(t, a.Before, `"policy":"ROLLOUT_POLICY_STAGED"`)
	require.Contains(t, a.After, `"policy":"ROLLOUT_POLICY_AUTO"`)

	// Upserting keeps the region's version pointer.
	b.mkConfigVersion(1, "eu-west-1")
	_, err := c.PromoteVersion(ctx, connect.NewRequest(&adminv1.PromoteVersionRequest{Region: "eu-west-1", Version: 1}))
	require.NoError(t, err)
	requireOneChange(t, b, "updated", "eu-west-1", upsert("eu-west-1", adminv1.RolloutPolicy_ROLLOUT_POLICY_STAGED))
	cur, _ := b.regionRow("eu-west-1")
	require.Equal(t, int64(1), cur)

	for _, bad := range []string{"", "EU", "-eu", "eu-", "eu_west", "eu.west", strings.Repeat("a", 64), "é"} {
		requireNoChange(t, b, "invalid_argument", upsert(bad, adminv1.RolloutPolicy_ROLLOUT_POLICY_AUTO), "name")
	}
	requireOneChange(t, b, "created", strings.Repeat("a", 63), upsert(strings.Repeat("a", 63), adminv1.RolloutPolicy_ROLLOUT_POLICY_AUTO))
	requireOneChange(t, b, "created", "1", upsert("1", adminv1.RolloutPolicy_ROLLOUT_POLICY_AUTO))
	requireNoChange(t, b, "invalid_argument", upsert("us-east", adminv1.RolloutPolicy_ROLLOUT_POLICY_UNSPECIFIED), "policy", "required")
	requireNoChange(t, b, "invalid_argument", upsert("us-east", adminv1.RolloutPolicy(7)), "policy", "unknown value 7")
	requireNoChange(t, b, "invalid_argument", upsert("US", 0), "name", "policy")

	st, err := c.GetRolloutStatus(ctx, connect.NewRequest(&adminv1.GetRolloutStatusRequest{}))
	require.NoError(t, err)
	var names []string
	for _, r := range st.Msg.Regions {
		names = append(names, r.Region.Name)
	}
	require.Equal(t, []string{"1", strings.Repeat("a", 63), "default", "eu-west-1"}, names)
}

func TestPromoteAndRollback(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	c := b.fleetAs(b.bootstrap).Rollout
	promote := func(region string, v uint64) func() error {
		return func() error {
			_, err := c.PromoteVersion(ctx, connect.NewRequest(&adminv1.PromoteVersionRequest{Region: region, Version: v}))
			return err
		}
	}
	rollback := func(region string, v uint64) func() error {
		return func() error {
			_, err := c.RollbackRegion(ctx, connect.NewRequest(&adminv1.RollbackRegionRequest{Region: region, Version: v}))
			return err
		}
	}
	for v := uint64(1); v <= 3; v++ {
		b.mkConfigVersion(v, "default")
	}

	requireNoChange(t, b, "invalid_argument", promote("default", 0), "version")
	requireNoChange(t, b, "invalid_argument", promote("", 1), "region")
	requireNoChange(t, b, "invalid_argument", rollback("Bad_Region", 1), "region")
	requireNoChange(t, b, "not_found", promote("mars", 1), "region mars not found")
	requireNoChange(t, b, "not_found", promote("default", 9), "config version 9 not found")
	requireNoChange(t, b, "not_found", promote("default", 1<<63), "not found")

	requireOneChange(t, b, "promoted", "default", promote("default", 2))
	cur, rb := b.regionRow("default")
	require.Equal(t, int64(2), cur)
	require.False(t, rb)
	require.Contains(t, b.lastAudit().Before, `"name":"default"`)
	require.NotContains(t, b.lastAudit().Before, `"current_version"`, "before: version 0")
	require.Contains(t, b.lastAudit().After, `"current_version":"2"`)

	requireNoChange(t, b, "failed_precondition", promote("default", 1), "older", "RollbackRegion")
	requireOneChange(t, b, "promoted", "default", promote("default", 2)) // same version: allowed
	requireNoChange(t, b, "failed_precondition", rollback("default", 2), "not older", "PromoteVersion")
	requireNoChange(t, b, "failed_precondition", rollback("default", 3), "not older")
	requireNoChange(t, b, "not_found", rollback("default", 7), "config version 7 not found")
	requireNoChange(t, b, "not_found", rollback("mars", 1), "region mars not found")

	var out *adminv1.Region
	requireOneChange(t, b, "rolled_back", "default", func() error {
		resp, err := c.RollbackRegion(ctx, connect.NewRequest(&adminv1.RollbackRegionRequest{Region: "default", Version: 1}))
		if err == nil {
			out = resp.Msg.Region
		}
		return err
	})
	require.Equal(t, uint64(1), out.CurrentVersion)
	cur, rb = b.regionRow("default")
	require.Equal(t, int64(1), cur)
	require.True(t, rb, "a rollback is marked so data planes accept the lower version")

	requireOneChange(t, b, "promoted", "default", promote("default", 3))
	cur, rb = b.regionRow("default")
	require.Equal(t, int64(3), cur)
	require.False(t, rb, "a promotion clears the rollback mark")

	// A region created after a version was compiled has no stream position
	// in it, so that version cannot be pointed at for the region.
	_, err := c.UpsertRegion(ctx, connect.NewRequest(&adminv1.UpsertRegionRequest{Name: "late", Policy: adminv1.RolloutPolicy_ROLLOUT_POLICY_STAGED}))
	require.NoError(t, err)
	requireNoChange(t, b, "failed_precondition", promote("late", 3), "compiled before region late existed")
	b.mkConfigVersion(4, "default", "late")
	requireOneChange(t, b, "promoted", "late", promote("late", 4))
}

func TestFleetAndRolloutArePlatformOnly(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	org := b.mkOrg("acme")
	team, err := b.root().Team.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{OrgId: org.Id, Name: "t"}))
	require.NoError(t, err)
	b.mkConfigVersion(1, "default")
	b.mkConfigVersion(2, "default")

	type call struct {
		name  string
		write bool
		do    func(fleetClients) error
	}
	calls := []call{
		{"ListDataPlanes", false, func(c fleetClients) error {
			_, err := c.Fleet.ListDataPlanes(ctx, connect.NewRequest(&adminv1.ListDataPlanesRequest{}))
			return err
		}},
		{"GetRolloutStatus", false, func(c fleetClients) error {
			_, err := c.Rollout.GetRolloutStatus(ctx, connect.NewRequest(&adminv1.GetRolloutStatusRequest{}))
			return err
		}},
		{"UpsertRegion", true, func(c fleetClients) error {
			_, err := c.Rollout.UpsertRegion(ctx, connect.NewRequest(&adminv1.UpsertRegionRequest{Name: "eu", Policy: adminv1.RolloutPolicy_ROLLOUT_POLICY_AUTO}))
			return err
		}},
		{"PromoteVersion", true, func(c fleetClients) error {
			_, err := c.Rollout.PromoteVersion(ctx, connect.NewRequest(&adminv1.PromoteVersionRequest{Region: "default", Version: 2}))
			return err
		}},
		{"RollbackRegion", true, func(c fleetClients) error {
			_, err := c.Rollout.RollbackRegion(ctx, connect.NewRequest(&adminv1.RollbackRegionRequest{Region: "default", Version: 1}))
			return err
		}},
	}

	denied := map[string]string{
		"org admin":  b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_ADMIN, org.Id, ""),
		"org viewer": b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_VIEWER, org.Id, ""),
		"team admin": b.mkToken(adminv1.Scope_SCOPE_TEAM, adminv1.Role_ROLE_ADMIN, org.Id, team.Msg.Team.Id),
	}
	audits, events := b.auditCount(), b.outboxCount()
	for who, tok := range denied {
		for _, c := range calls {
			err := c.do(b.fleetAs(tok))
			require.Equal(t, "permission_denied", codeOf(err), "%s calls %s: %v", who, c.name, err)
			if who != "org viewer" { // a viewer is refused for its role first
				require.Contains(t, err.Error(), "platform-scoped token", "%s calls %s", who, c.name)
			}
		}
	}
	require.Equal(t, audits, b.auditCount(), "refused calls write no audit rows")
	require.Equal(t, events, b.outboxCount(), "refused calls write no outbox rows")

	viewer := b.fleetAs(b.mkToken(adminv1.Scope_SCOPE_PLATFORM, adminv1.Role_ROLE_VIEWER, "", ""))
	editor := b.fleetAs(b.mkToken(adminv1.Scope_SCOPE_PLATFORM, adminv1.Role_ROLE_EDITOR, "", ""))
	for _, c := range calls {
		if !c.write {
			require.NoError(t, c.do(viewer), "platform viewer reads %s", c.name)
			continue
		}
		requireNoChange(t, b, "permission_denied", func() error { return c.do(viewer) }, "role viewer")
		before := b.auditCount()
		require.NoError(t, c.do(editor), "platform editor calls %s", c.name)
		require.Equal(t, before+1, b.auditCount(), c.name)
	}
	// The audit record names the token that made the change.
	var tokenID string
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT token_id FROM audit_log ORDER BY seq DESC LIMIT 1`).Scan(&tokenID))
	require.True(t, strings.HasPrefix(tokenID, "tok_"), tokenID)
}

func TestListDataPlanes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	c := b.fleetAs(b.bootstrap).Fleet
	rejectedAt := time.Date(2026, 11, 1, 11, 59, 0, 0, time.UTC)
	audits, events := b.auditCount(), b.outboxCount()

	require.NoError(t, b.store.DataPlaneUpsert(ctx, store.DataPlane{
		InstanceID: "dp-b", Region: "default", AppliedVersion: 3, EventsSeq: 30, RegionSeq: 300, Health: "ok",
		InFlight: 4, StalenessSeconds: 0.5,
		Rejected: []store.RejectedSnapshot{{Version: 4, Reason: "digest mismatch", Time: rejectedAt}},
		Backlog:  []store.ClassBacklog{{TrafficClass: "interactive", InFlight: 2}, {TrafficClass: "agent", InFlight: 6, Queued: 3, Shed: 2}},
		// LastSeen is the store's clock, whatever the caller passes.
		LastSeen: time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC),
	}))
	require.NoError(t, b.store.DataPlaneUpsert(ctx, store.DataPlane{InstanceID: "dp-a", Region: "default", AppliedVersion: 2, Health: "starting"}))
	require.NoError(t, b.store.DataPlaneUpsert(ctx, store.DataPlane{InstanceID: "dp-c", Region: "eu", AppliedVersion: 1, Health: "stale", StalenessSeconds: 42}))
	require.Equal(t, audits, b.auditCount(), "heartbeats are telemetry: not audited")
	require.Equal(t, events, b.outboxCount(), "heartbeats are not outbox events")

	for _, bad := range []store.DataPlane{
		{Region: "default"},
		{InstanceID: "x", Region: ""},
		{InstanceID: "x", Region: "Not A Region"},
		{InstanceID: "x", Region: "default", AppliedVersion: 1 << 63},
		{InstanceID: "x", Region: "default", Rejected: make([]store.RejectedSnapshot, 33)},
		{InstanceID: "x", Region: "default", Backlog: make([]store.ClassBacklog, 17)},
		{InstanceID: "x", Region: "default", Backlog: []store.ClassBacklog{{TrafficClass: "agent", Queued: -1}}},
		{InstanceID: "x", Region: "default", Backlog: []store.ClassBacklog{{TrafficClass: strings.Repeat("c", 33)}}},
	} {
		err := b.store.DataPlaneUpsert(ctx, bad)
		require.True(t, errors.Is(err, store.ErrBadHeartbeat), "%+v: %v", bad, err)
	}

	seen := timestamppb.New(b.clock.Now())
	resp, err := c.ListDataPlanes(ctx, connect.NewRequest(&adminv1.ListDataPlanesRequest{}))
	require.NoError(t, err)
	want := []*adminv1.DataPlane{
		{InstanceId: "dp-a", Region: "default", AppliedVersion: 2, Health: "starting", LastSeen: seen},
		{InstanceId: "dp-b", Region: "default", AppliedVersion: 3, EventsSeq: 30, Health: "ok", InFlight: 4,
			StalenessSeconds: 0.5, LastSeen: seen,
			RejectedSnapshots: []*adminv1.RejectedSnapshot{{Version: 4, Reason: "digest mismatch", Time: timestamppb.New(rejectedAt)}},
			AdmissionBacklog:  []*adminv1.AdmissionBacklog{{TrafficClass: "interactive", InFlight: 2}, {TrafficClass: "agent", InFlight: 6, Queued: 3, Shed: 2}}},
		{InstanceId: "dp-c", Region: "eu", AppliedVersion: 1, Health: "stale", StalenessSeconds: 42, LastSeen: seen},
	}
	requireProtoEqual(t, &adminv1.ListDataPlanesResponse{DataPlanes: want}, resp.Msg)

	resp, err = c.ListDataPlanes(ctx, connect.NewRequest(&adminv1.ListDataPlanesRequest{Region: "eu"}))
	require.NoError(t, err)
	requireProtoEqual(t, &adminv1.ListDataPlanesResponse{DataPlanes: want[2:]}, resp.Msg)
	resp, err = c.ListDataPlanes(ctx, connect.NewRequest(&adminv1.ListDataPlanesRequest{Region: "nowhere"}))
	require.NoError(t, err)
	require.Empty(t, resp.Msg.DataPlanes)
	_, err = c.ListDataPlanes(ctx, connect.NewRequest(&adminv1.ListDataPlanesRequest{Region: "Bad Region"}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.Contains(t, err.Error(), "region")

	// Three heartbeat intervals without a heartbeat: still what it said;
	// a moment more: lost.
	health := func() map[string]string {
		resp, err := c.ListDataPlanes(ctx, connect.NewRequest(&adminv1.ListDataPlanesRequest{}))
		require.NoError(t, err)
		out := map[string]string{}
		for _, d := range resp.Msg.DataPlanes {
			out[d.InstanceId] = d.Health
		}
		return out
	}
	b.clock.Advance(3 * 5 * time.Second)
	require.Equal(t, map[string]string{"dp-a": "starting", "dp-b": "ok", "dp-c": "stale"}, health())
	b.clock.Advance(time.Minute)
	require.Equal(t, map[string]string{"dp-a": "lost", "dp-b": "lost", "dp-c": "lost"}, health())

	// A new heartbeat replaces the instance's row and brings it back.
	require.NoError(t, b.store.DataPlaneUpsert(ctx, store.DataPlane{InstanceID: "dp-b", Region: "default", AppliedVersion: 5, Health: "ok"}))
	require.Equal(t, map[string]string{"dp-a": "lost", "dp-b": "ok", "dp-c": "lost"}, health())
	resp, err = c.ListDataPlanes(ctx, connect.NewRequest(&adminv1.ListDataPlanesRequest{Region: "default"}))
	require.NoError(t, err)
	require.Len(t, resp.Msg.DataPlanes, 2)
	require.Equal(t, uint64(5), resp.Msg.DataPlanes[1].AppliedVersion)
	require.Empty(t, resp.Msg.DataPlanes[1].RejectedSnapshots, "the new heartbeat's (empty) rejections replace the old")
	require.True(t, resp.Msg.DataPlanes[1].LastSeen.AsTime().Equal(b.clock.Now()))
}

func TestGetRolloutStatus(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	c := b.fleetAs(b.bootstrap).Rollout

	st, err := c.GetRolloutStatus(ctx, connect.NewRequest(&adminv1.GetRolloutStatusRequest{}))
	require.NoError(t, err)
	require.Nil(t, st.Msg.Latest, "no version compiled yet")
	require.Len(t, st.Msg.Regions, 1)
	requireProtoEqual(t, &adminv1.GetRolloutStatusResponse{Regions: []*adminv1.RegionStatus{{Region: &adminv1.Region{Name: "default",
		Policy: adminv1.RolloutPolicy_ROLLOUT_POLICY_AUTO, UpdateTime: st.Msg.Regions[0].Region.UpdateTime}}}}, st.Msg)

	_, err = c.UpsertRegion(ctx, connect.NewRequest(&adminv1.UpsertRegionRequest{Name: "eu", Policy: adminv1.RolloutPolicy_ROLLOUT_POLICY_STAGED}))
	require.NoError(t, err)
	_, err = c.UpsertRegion(ctx, connect.NewRequest(&adminv1.UpsertRegionRequest{Name: "ap", Policy: adminv1.RolloutPolicy_ROLLOUT_POLICY_STAGED}))
	require.NoError(t, err)
	b.mkConfigVersion(1, "default", "eu", "ap")
	b.mkConfigVersion(2, "default", "eu", "ap")
	_, err = c.PromoteVersion(ctx, connect.NewRequest(&adminv1.PromoteVersionRequest{Region: "default", Version: 2}))
	require.NoError(t, err)
	_, err = c.PromoteVersion(ctx, connect.NewRequest(&adminv1.PromoteVersionRequest{Region: "eu", Version: 1}))
	require.NoError(t, err)
	require.NoError(t, b.store.DataPlaneUpsert(ctx, store.DataPlane{InstanceID: "eu-1", Region: "eu", AppliedVersion: 1, Health: "ok"}))
	require.NoError(t, b.store.DataPlaneUpsert(ctx, store.DataPlane{InstanceID: "def-2", Region: "default", AppliedVersion: 2, Health: "ok"}))
	require.NoError(t, b.store.DataPlaneUpsert(ctx, store.DataPlane{InstanceID: "def-1", Region: "default", AppliedVersion: 1, Health: "ok"}))
	// An instance of a region the control plane does not know shows in
	// ListDataPlanes, not under any region.
	require.NoError(t, b.store.DataPlaneUpsert(ctx, store.DataPlane{InstanceID: "x-1", Region: "unknown", Health: "ok"}))

	st, err = c.GetRolloutStatus(ctx, connect.NewRequest(&adminv1.GetRolloutStatusRequest{}))
	require.NoError(t, err)
	now := timestamppb.New(b.clock.Now())
	requireProtoEqual(t, &adminv1.ConfigVersion{Version: 2, EventsSeq: 20, Digest: digestOf(2), SizeBytes: 1002, CreateTime: now},
		st.Msg.Latest)
	type view struct {
		name      string
		policy    adminv1.RolloutPolicy
		version   uint64
		instances map[string]uint64
	}
	var got []view
	for _, r := range st.Msg.Regions {
		v := view{name: r.Region.Name, policy: r.Region.Policy, version: r.Region.CurrentVersion, instances: map[string]uint64{}}
		for _, d := range r.DataPlanes {
			require.Equal(t, r.Region.Name, d.Region)
			v.instances[d.InstanceId] = d.AppliedVersion
		}
		got = append(got, v)
	}
	require.Equal(t, []view{
		{"ap", adminv1.RolloutPolicy_ROLLOUT_POLICY_STAGED, 0, map[string]uint64{}},
		{"default", adminv1.RolloutPolicy_ROLLOUT_POLICY_AUTO, 2, map[string]uint64{"def-1": 1, "def-2": 2}},
		{"eu", adminv1.RolloutPolicy_ROLLOUT_POLICY_STAGED, 1, map[string]uint64{"eu-1": 1}},
	}, got)

	b.clock.Advance(time.Minute)
	st, err = c.GetRolloutStatus(ctx, connect.NewRequest(&adminv1.GetRolloutStatusRequest{}))
	require.NoError(t, err)
	require.Equal(t, "lost", st.Msg.Regions[2].DataPlanes[0].Health)
}
