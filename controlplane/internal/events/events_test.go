package events

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/testsvc"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// TestRegistry: every kind is "<prefix>.<op>" with its object and
// operation registered once, every object a kind is about has a loader,
// and each (object, operation) pair names exactly one kind.
func TestRegistry(t *testing.T) {
	opNames := map[Op]string{OpUpsert: "upserted", OpDelete: "deleted", OpBlock: "blocked", OpUnblock: "unblocked",
		OpRotate: "rotated", OpPointer: "pointer", OpGrant: "granted", OpRevoke: "revoked"}
	seen := map[[2]any]Kind{}
	for _, k := range Kinds() {
		s, err := Lookup(string(k))
		require.NoError(t, err)
		require.Equal(t, k, s.Kind)
		_, op, ok := strings.Cut(string(k), ".")
		require.True(t, ok, "kind %s", k)
		require.Equal(t, opNames[s.Op], op, "kind %s", k)
		key := [2]any{s.Object, s.Op}
		require.Empty(t, seen[key], "%s and %s are both %v", k, seen[key], key)
		seen[key] = k
		require.Equal(t, k, For(s.Object, s.Op))
		if s.Op != OpPointer {
			o, ok := objects[s.Object]
			require.True(t, ok, "kind %s: object %s has no loader", k, s.Object)
			require.NotNil(t, o.load)
			require.NotNil(t, o.deleted)
			require.NotNil(t, o.ref)
		}
	}
	require.Len(t, Kinds(), 34)
	_, err := Lookup("org.renamed")
	require.ErrorIs(t, err, ErrUnknownKind)
	require.Equal(t, Kind(""), For(ObjModelGroup, OpBlock))
}

// TestSecurity: blocks, deletions and revocations always reach every
// region, a rotation only without grace (or when its payload cannot say),
// nothing else.
func TestSecurity(t *testing.T) {
	for _, k := range Kinds() {
		s, _ := Lookup(string(k))
		want := s.Op == OpBlock || s.Op == OpDelete || s.Op == OpRotate || s.Op == OpRevoke
		require.Equal(t, want, s.Security(nil), "kind %s without payload", k)
	}
	rot, _ := Lookup(string(KeyRotated))
	require.True(t, rot.Security([]byte(`{}`)))
	require.True(t, rot.Security([]byte(`not json`)), "fail closed")
	require.False(t, rot.Security([]byte(`{"grace_until":"2030-01-01T00:00:00Z"}`)))
}

// TestNew: rows carry the registry's object type and the payload's JSON;
// a kind outside the registry is refused.
func TestNew(t *testing.T) {
	ev, err := New(KeyRotated, "org_1", "key_1", KeyRotatedPayload{GraceUntil: "2030-01-01T00:00:00Z"})
	require.NoError(t, err)
	require.Equal(t, store.OutboxEvent{Kind: "key.rotated", OrgID: "org_1", ObjectType: "key", ObjectID: "key_1",
		Payload: []byte(`{"grace_until":"2030-01-01T00:00:00Z"}`)}, ev)
	ev, err = Member(MemberDeleted, "org_1", "team_1", "user_1")
	require.NoError(t, err)
	require.Equal(t, store.OutboxEvent{Kind: "member.deleted", OrgID: "org_1", ObjectType: "team_member", ObjectID: "team_1/user_1",
		Payload: []byte(`{"team_id":"team_1","user_id":"user_1"}`)}, ev)
	ev, err = New(RegionPointer, "", "eu", RegionPointerPayload{Region: "eu"})
	require.NoError(t, err)
	require.Equal(t, "region", ev.ObjectType)
	_, err = New("org.renamed", "org_1", "org_1", nil)
	require.ErrorIs(t, err, ErrUnknownKind)
}

// TestBuild turns rows into events against a real database: a block
// carries only the flag, a deletion (or an object gone since its row) the
// id, an upsert the object's current state; rows the registry does not
// hold, pointer rows and rows whose object type disagrees with their kind
// are errors.
func TestBuild(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testsvc.NewDatabase(t))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	st := store.New(pool, nil)
	require.NoError(t, st.Mutate(ctx, store.Actor{ID: "test"}, func(tx *store.Tx) error {
		if err := tx.OrgInsert(ctx, &store.Org{ID: "org_b", Name: "b"}); err != nil {
			return err
		}
		return tx.Audit(ctx, "created", "org", "org_b", "org_b", "", nil, []byte(`{}`))
	}))
	at := time.Now().UTC().Truncate(time.Microsecond)
	row := func(kind, typ, id, payload string) store.OutboxRow {
		return store.OutboxRow{Seq: 7, At: at, Kind: kind, OrgID: "org_b", ObjectType: typ, ObjectID: id, Payload: []byte(payload)}
	}

	ev, err := Build(ctx, st, row("org.upserted", "org", "org_b", "{}"), time.Now())
	require.NoError(t, err)
	require.Equal(t, uint64(7), ev.GetSeq())
	require.Equal(t, "org.upserted", ev.GetKind())
	require.False(t, ev.GetSecurity())
	require.Equal(t, "org_b", ev.GetOrg().GetId())

	ev, err = Build(ctx, st, row("org.blocked", "org", "org_b", "{}"), time.Now())
	require.NoError(t, err)
	require.True(t, ev.GetSecurity())
	require.Equal(t, &configv1.BlockChange{ObjectType: "org", Id: "org_b", Blocked: true}, ev.GetBlock())

	ev, err = Build(ctx, st, row("org.deleted", "org", "org_b", "{}"), time.Now())
	require.NoError(t, err)
	require.Equal(t, "org_b", ev.GetOrgDeleted(), "a deletion carries the id even while the row is still there")

	ev, err = Build(ctx, st, row("team.upserted", "team", "team_gone", "{}"), time.Now())
	require.NoError(t, err)
	require.Equal(t, "team_gone", ev.GetTeamDeleted(), "an object gone since its row is deleted")

	ev, err = Build(ctx, st, row("member.upserted", "team_member", "team_x/user_y", "{}"), time.Now())
	require.NoError(t, err)
	require.Equal(t, "team_x", ev.GetMemberDeleted().GetTeamId(), "a member's ids from its object id when the payload lacks them")
	require.Equal(t, "user_y", ev.GetMemberDeleted().GetUserId())

	require.NoError(t, st.Mutate(ctx, store.Actor{ID: "test"}, func(tx *store.Tx) error {
		if err := tx.LabelScopeInsert(ctx, &store.LabelScope{ID: "lsc_x", OrgID: "org_b", Kind: store.LabelKindTag, Name: "nightly",
			Limits: []byte(`{"rpmLimit":"5"}`)}); err != nil {
			return err
		}
		return tx.Audit(ctx, "created", "label_scope", "lsc_x", "org_b", "", nil, []byte(`{}`))
	}))
	ev, err = Build(ctx, st, row("label_scope.upserted", "label_scope", "lsc_x", "{}"), time.Now())
	require.NoError(t, err)
	require.False(t, ev.GetSecurity())
	want := &configv1.LabelScope{Id: "lsc_x", OrgId: "org_b", Kind: "tag", Name: "nightly", Limits: &configv1.Limits{RpmLimit: proto.Int64(5)}}
	require.True(t, proto.Equal(want, ev.GetLabelScope()), "%v", ev.GetLabelScope())
	ev, err = Build(ctx, st, row("label_scope.deleted", "label_scope", "lsc_x", "{}"), time.Now())
	require.NoError(t, err)
	require.True(t, ev.GetSecurity())
	require.Equal(t, "lsc_x", ev.GetLabelScopeDeleted())

	_, err = Build(ctx, st, row("org.renamed", "org", "org_b", "{}"), time.Now())
	require.ErrorIs(t, err, ErrUnknownKind)
	_, err = Build(ctx, st, row("region.pointer", "region", "default", `{"region":"default"}`), time.Now())
	require.Error(t, err)
	_, err = Build(ctx, st, row("org.upserted", "team", "org_b", "{}"), time.Now())
	require.Error(t, err)
	require.False(t, errors.Is(err, ErrUnknownKind))
}
