// Package events is the one registry of the control plane's outbox event
// kinds: for each kind, the object it is about, what happened to it (its
// operation), whether it is a security event, and how the publisher turns
// the outbox row into the state-carrying wire event (the loader reads the
// object's current state from the store, package configmsg converts it).
//
// The admin handlers write rows only through New, with the kind's typed
// constant and its payload type from this package; the publisher reads them
// back only through Build. Nothing else matches kinds by string: the data
// plane applies the event's typed change (sluice.config.v1.Event.change)
// and reads the kind only to name it in errors.
package events

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/configmsg"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// Kind names an outbox event ("org.blocked"); stored in outbox.kind and
// carried in sluice.config.v1.Event.kind.
type Kind string

// Object is the type of object an event is about (outbox.object_type).
type Object string

// Objects.
const (
	ObjOrg      Object = "org"
	ObjTeam     Object = "team"
	ObjMember   Object = "team_member"
	ObjUser     Object = "user"
	ObjCustomer Object = "customer"
	// ObjLabelScope is a project or tag scope of an org (docs/limits.md).
	ObjLabelScope Object = "label_scope"
	ObjKey        Object = "key"
	ObjModelGroup Object = "model_group"
	ObjDeployment Object = "deployment"
	// ObjTrustedIssuer is a JWT issuer an org trusts (docs/jwt.md).
	ObjTrustedIssuer Object = "trusted_issuer"
	// ObjRegion rows are instructions to the publisher, not events.
	ObjRegion Object = "region"
)

// Op is what happened to the object.
type Op uint8

// Operations.
const (
	OpUpsert Op = iota + 1
	OpDelete
	OpBlock
	OpUnblock
	OpRotate
	// OpPointer asks the publisher to rewrite a region's KV pointer; it
	// reaches no stream.
	OpPointer
	// OpGrant widens who may use an object (a model group granted to an
	// org); the event carries the object as it is now.
	OpGrant
	// OpRevoke narrows it (a grant taken away, a group no longer
	// platform-wide): a security event carrying the object as it is now.
	OpRevoke
)

// Kinds.
const (
	OrgUpserted       Kind = "org.upserted"
	OrgDeleted        Kind = "org.deleted"
	OrgBlocked        Kind = "org.blocked"
	OrgUnblocked      Kind = "org.unblocked"
	TeamUpserted      Kind = "team.upserted"
	TeamDeleted       Kind = "team.deleted"
	TeamBlocked       Kind = "team.blocked"
	TeamUnblocked     Kind = "team.unblocked"
	MemberUpserted    Kind = "member.upserted"
	MemberDeleted     Kind = "member.deleted"
	UserUpserted      Kind = "user.upserted"
	UserDeleted       Kind = "user.deleted"
	UserBlocked       Kind = "user.blocked"
	UserUnblocked     Kind = "user.unblocked"
	CustomerUpserted  Kind = "customer.upserted"
	CustomerDeleted   Kind = "customer.deleted"
	CustomerBlocked   Kind = "customer.blocked"
	CustomerUnblocked Kind = "customer.unblocked"
	// A label scope's deletion lifts limits: it reaches every region at
	// once like any deletion, and is not a revocation.
	LabelScopeUpserted Kind = "label_scope.upserted"
	LabelScopeDeleted  Kind = "label_scope.deleted"
	KeyUpserted        Kind = "key.upserted"
	KeyDeleted         Kind = "key.deleted"
	KeyRotated         Kind = "key.rotated"
	KeyBlocked         Kind = "key.blocked"
	KeyUnblocked       Kind = "key.unblocked"
	// Model groups and deployments are platform objects (org_id ""). A
	// deleted deployment is a security event: a removed upstream stops
	// receiving traffic in every region at once.
	ModelGroupUpserted Kind = "model_group.upserted"
	ModelGroupDeleted  Kind = "model_group.deleted"
	DeploymentUpserted Kind = "deployment.upserted"
	DeploymentDeleted  Kind = "deployment.deleted"
	// Grants of model groups to orgs (docs/tenancy.md): both carry the
	// group with its grants as they are now; a revocation (a grant taken
	// away, or the platform-wide mark cleared) is a security event.
	ModelGroupGranted Kind = "model_group.granted"
	ModelGroupRevoked Kind = "model_group.revoked"
	// A deleted trusted issuer is a security event: its tokens stop in
	// every region at once.
	TrustedIssuerUpserted Kind = "trusted_issuer.upserted"
	TrustedIssuerDeleted  Kind = "trusted_issuer.deleted"
	// RegionPointer asks the publisher to rewrite a region's KV pointer
	// (payload RegionPointerPayload).
	RegionPointer Kind = "region.pointer"
)

// Payloads: the JSON object of an outbox row, one type per kind that has
// one (the others store {}).

// KeyRotatedPayload is the payload of key.rotated.
type KeyRotatedPayload struct {
	// GraceUntil (RFC 3339) is when the previous token stops working;
	// absent when it stopped at once (then the rotation is a security
	// event: the old token must stop everywhere now).
	GraceUntil string `json:"grace_until,omitempty"`
}

// MemberPayload is the payload of member.* events: the membership's two
// ids (its object id is "<team_id>/<user_id>").
type MemberPayload struct {
	TeamID string `json:"team_id"`
	UserID string `json:"user_id"`
}

// UserDeletedPayload is the payload of user.deleted: the teams whose
// memberships of the user were removed with it.
type UserDeletedPayload struct {
	TeamIDs []string `json:"team_ids"`
}

// RegionPointerPayload is the payload of region.pointer.
type RegionPointerPayload struct {
	Region string `json:"region"`
}

// Spec is one registered kind.
type Spec struct {
	Kind   Kind
	Object Object
	Op     Op
}

// object is how the publisher turns an object's rows into changes.
type object struct {
	// load reads the object's current state and converts it;
	// store.ErrNotFound means it is gone.
	load func(ctx context.Context, st *store.Store, ref ref, now time.Time, ev *configv1.Event) error
	// deleted sets the change of a deleted (or vanished) object.
	deleted func(ref ref, ev *configv1.Event)
	// ref decodes the row's identity (the id, or a member's two ids).
	ref func(id string, payload []byte) ref
}

// ref identifies the object of a row.
type ref struct {
	id             string
	teamID, userID string // members
}

func idRef(id string, _ []byte) ref { return ref{id: id} }

var all = store.Tenant{}

// loader makes an object's load: get reads the object of a row, conv
// converts it (now is the clock of key grace periods) and set makes the
// result the event's change.
func loader[T, M any](
	get func(context.Context, *store.Store, ref) (T, error),
	conv func(T, time.Time) (M, error),
	set func(*configv1.Event, M),
) func(context.Context, *store.Store, ref, time.Time, *configv1.Event) error {
	return func(ctx context.Context, st *store.Store, r ref, now time.Time, ev *configv1.Event) error {
		v, err := get(ctx, st, r)
		if err != nil {
			return err
		}
		m, err := conv(v, now)
		set(ev, m)
		return err
	}
}

// byID reads a row's object with a store getter by id.
func byID[T any](get func(*store.Store, context.Context, string) (T, error)) func(context.Context, *store.Store, ref) (T, error) {
	return func(ctx context.Context, st *store.Store, r ref) (T, error) { return get(st, ctx, r.id) }
}

// byIDInAnyOrg reads a row's object with a tenant-filtered store getter,
// in every org.
func byIDInAnyOrg[T any](get func(*store.Store, context.Context, store.Tenant, string) (T, error)) func(context.Context, *store.Store, ref) (T, error) {
	return func(ctx context.Context, st *store.Store, r ref) (T, error) { return get(st, ctx, all, r.id) }
}

// timeless adapts a converter that does not depend on the clock.
func timeless[T, M any](conv func(T) (M, error)) func(T, time.Time) (M, error) {
	return func(v T, _ time.Time) (M, error) { return conv(v) }
}

// objects are the loaders and converters, one per object type.
var objects = map[Object]object{
	ObjOrg: {ref: idRef,
		load: loader(byIDInAnyOrg((*store.Store).OrgGet), timeless(configmsg.Org),
			func(ev *configv1.Event, m *configv1.Org) { ev.Change = &configv1.Event_Org{Org: m} }),
		deleted: func(r ref, ev *configv1.Event) { ev.Change = &configv1.Event_OrgDeleted{OrgDeleted: r.id} }},
	ObjTeam: {ref: idRef,
		load: loader(byIDInAnyOrg((*store.Store).TeamGet), timeless(configmsg.Team),
			func(ev *configv1.Event, m *configv1.Team) { ev.Change = &configv1.Event_Team{Team: m} }),
		deleted: func(r ref, ev *configv1.Event) { ev.Change = &configv1.Event_TeamDeleted{TeamDeleted: r.id} }},
	ObjUser: {ref: idRef,
		load: loader(byIDInAnyOrg((*store.Store).UserGet), timeless(configmsg.User),
			func(ev *configv1.Event, m *configv1.User) { ev.Change = &configv1.Event_User{User: m} }),
		deleted: func(r ref, ev *configv1.Event) { ev.Change = &configv1.Event_UserDeleted{UserDeleted: r.id} }},
	ObjCustomer: {ref: idRef,
		load: loader(byIDInAnyOrg((*store.Store).CustomerGet), timeless(configmsg.Customer),
			func(ev *configv1.Event, m *configv1.Customer) { ev.Change = &configv1.Event_Customer{Customer: m} }),
		deleted: func(r ref, ev *configv1.Event) {
			ev.Change = &configv1.Event_CustomerDeleted{CustomerDeleted: r.id}
		}},
	ObjLabelScope: {ref: idRef,
		load: loader(byIDInAnyOrg((*store.Store).LabelScopeGet), timeless(configmsg.LabelScope),
			func(ev *configv1.Event, m *configv1.LabelScope) {
				ev.Change = &configv1.Event_LabelScope{LabelScope: m}
			}),
		deleted: func(r ref, ev *configv1.Event) {
			ev.Change = &configv1.Event_LabelScopeDeleted{LabelScopeDeleted: r.id}
		}},
	ObjKey: {ref: idRef,
		load: loader(byID((*store.Store).ConfigKeyGet), configmsg.Key,
			func(ev *configv1.Event, m *configv1.Key) { ev.Change = &configv1.Event_Key{Key: m} }),
		deleted: func(r ref, ev *configv1.Event) { ev.Change = &configv1.Event_KeyDeleted{KeyDeleted: r.id} }},
	ObjMember: {
		ref: func(id string, payload []byte) ref {
			var p MemberPayload
			if err := json.Unmarshal(payload, &p); err != nil || p.TeamID == "" || p.UserID == "" {
				if i := strings.IndexByte(id, '/'); i > 0 {
					p.TeamID, p.UserID = id[:i], id[i+1:]
				}
			}
			return ref{id: id, teamID: p.TeamID, userID: p.UserID}
		},
		load: loader(func(ctx context.Context, st *store.Store, r ref) (store.TeamMember, error) {
			return st.ConfigMemberGet(ctx, r.teamID, r.userID)
		}, timeless(configmsg.Member),
			func(ev *configv1.Event, m *configv1.Member) { ev.Change = &configv1.Event_Member{Member: m} }),
		deleted: func(r ref, ev *configv1.Event) {
			ev.Change = &configv1.Event_MemberDeleted{MemberDeleted: &configv1.MemberRef{TeamId: r.teamID, UserId: r.userID}}
		}},
	ObjModelGroup: {ref: idRef,
		load: loader(byID((*store.Store).ModelGroupGet), timeless(configmsg.ModelGroup),
			func(ev *configv1.Event, m *configv1.ModelGroup) {
				ev.Change = &configv1.Event_ModelGroup{ModelGroup: m}
			}),
		deleted: func(r ref, ev *configv1.Event) {
			ev.Change = &configv1.Event_ModelGroupDeleted{ModelGroupDeleted: r.id}
		}},
	ObjDeployment: {ref: idRef,
		load: loader(byID((*store.Store).DeploymentGet), timeless(configmsg.Deployment),
			func(ev *configv1.Event, m *configv1.Deployment) {
				ev.Change = &configv1.Event_Deployment{Deployment: m}
			}),
		deleted: func(r ref, ev *configv1.Event) {
			ev.Change = &configv1.Event_DeploymentDeleted{DeploymentDeleted: r.id}
		}},
	ObjTrustedIssuer: {ref: idRef,
		load: loader(byIDInAnyOrg((*store.Store).TrustedIssuerGet),
			func(ti store.TrustedIssuer, _ time.Time) (*configv1.TrustedIssuer, error) {
				return configmsg.TrustedIssuer(ti), nil
			},
			func(ev *configv1.Event, m *configv1.TrustedIssuer) {
				ev.Change = &configv1.Event_TrustedIssuer{TrustedIssuer: m}
			}),
		deleted: func(r ref, ev *configv1.Event) {
			ev.Change = &configv1.Event_TrustedIssuerDeleted{TrustedIssuerDeleted: r.id}
		}},
}

// registry is every kind.
var registry = func() map[Kind]Spec {
	m := map[Kind]Spec{}
	add := func(k Kind, o Object, op Op) { m[k] = Spec{Kind: k, Object: o, Op: op} }
	add(OrgUpserted, ObjOrg, OpUpsert)
	add(OrgDeleted, ObjOrg, OpDelete)
	add(OrgBlocked, ObjOrg, OpBlock)
	add(OrgUnblocked, ObjOrg, OpUnblock)
	add(TeamUpserted, ObjTeam, OpUpsert)
	add(TeamDeleted, ObjTeam, OpDelete)
	add(TeamBlocked, ObjTeam, OpBlock)
	add(TeamUnblocked, ObjTeam, OpUnblock)
	add(MemberUpserted, ObjMember, OpUpsert)
	add(MemberDeleted, ObjMember, OpDelete)
	add(UserUpserted, ObjUser, OpUpsert)
	add(UserDeleted, ObjUser, OpDelete)
	add(UserBlocked, ObjUser, OpBlock)
	add(UserUnblocked, ObjUser, OpUnblock)
	add(CustomerUpserted, ObjCustomer, OpUpsert)
	add(CustomerDeleted, ObjCustomer, OpDelete)
	add(CustomerBlocked, ObjCustomer, OpBlock)
	add(CustomerUnblocked, ObjCustomer, OpUnblock)
	add(LabelScopeUpserted, ObjLabelScope, OpUpsert)
	add(LabelScopeDeleted, ObjLabelScope, OpDelete)
	add(KeyUpserted, ObjKey, OpUpsert)
	add(KeyDeleted, ObjKey, OpDelete)
	add(KeyRotated, ObjKey, OpRotate)
	add(KeyBlocked, ObjKey, OpBlock)
	add(KeyUnblocked, ObjKey, OpUnblock)
	add(ModelGroupUpserted, ObjModelGroup, OpUpsert)
	add(ModelGroupDeleted, ObjModelGroup, OpDelete)
	add(ModelGroupGranted, ObjModelGroup, OpGrant)
	add(ModelGroupRevoked, ObjModelGroup, OpRevoke)
	add(DeploymentUpserted, ObjDeployment, OpUpsert)
	add(DeploymentDeleted, ObjDeployment, OpDelete)
	add(TrustedIssuerUpserted, ObjTrustedIssuer, OpUpsert)
	add(TrustedIssuerDeleted, ObjTrustedIssuer, OpDelete)
	add(RegionPointer, ObjRegion, OpPointer)
	return m
}()

// ErrUnknownKind is an outbox row of a kind the registry does not hold.
var ErrUnknownKind = errors.New("unknown event kind")

// Lookup returns the spec of kind.
func Lookup(kind string) (Spec, error) {
	s, ok := registry[Kind(kind)]
	if !ok {
		return Spec{}, fmt.Errorf("%w %q", ErrUnknownKind, kind)
	}
	return s, nil
}

// Kinds returns every registered kind, sorted.
func Kinds() []Kind {
	out := make([]Kind, 0, len(registry))
	for k := range registry {
		out = append(out, k)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// For returns the kind of op on objects of type o ("" when there is none).
func For(o Object, op Op) Kind {
	for k, s := range registry {
		if s.Object == o && s.Op == op {
			return k
		}
	}
	return ""
}

// Security reports whether a row of this kind with payload reaches every
// region at once (SPEC §6): blocks, deletions and revocations always, a
// rotation when the old token stops at once (no grace, or a payload that
// does not say otherwise: fail closed).
func (s Spec) Security(payload []byte) bool {
	switch s.Op {
	case OpBlock, OpDelete, OpRevoke:
		return true
	case OpRotate:
		var p KeyRotatedPayload
		_ = json.Unmarshal(payload, &p) // undecodable: no grace known, security
		return p.GraceUntil == ""
	}
	return false
}

// New builds the outbox row of kind about object id (of org orgID, "" for
// platform objects) with payload (nil: none; otherwise the kind's payload
// type, encoded as JSON). A kind the registry does not hold is an error.
func New(kind Kind, orgID, id string, payload any) (store.OutboxEvent, error) {
	s, ok := registry[kind]
	if !ok {
		return store.OutboxEvent{}, fmt.Errorf("%w %q", ErrUnknownKind, kind)
	}
	ev := store.OutboxEvent{Kind: string(kind), OrgID: orgID, ObjectType: string(s.Object), ObjectID: id}
	if payload != nil {
		b, err := json.Marshal(payload)
		if err != nil {
			return store.OutboxEvent{}, fmt.Errorf("encode %s payload: %w", kind, err)
		}
		ev.Payload = b
	}
	return ev, nil
}

// Member builds a member.* row: its object id is "<team_id>/<user_id>"
// and its payload the two ids.
func Member(kind Kind, orgID, teamID, userID string) (store.OutboxEvent, error) {
	return New(kind, orgID, MemberObjectID(teamID, userID), MemberPayload{TeamID: teamID, UserID: userID})
}

// MemberObjectID is the audit and outbox object id of a membership.
func MemberObjectID(teamID, userID string) string { return teamID + "/" + userID }

// Build turns an outbox row into the state-carrying event the data planes
// apply, reading the object's current state (a later row carries any later
// state): a block or unblock carries only the flag, a deletion (or an
// object gone since) the deleted id, anything else the object as it is
// now. now is the clock of key grace periods.
func Build(ctx context.Context, st *store.Store, row store.OutboxRow, now time.Time) (*configv1.Event, error) {
	s, err := Lookup(row.Kind)
	if err != nil {
		return nil, err
	}
	if string(s.Object) != row.ObjectType {
		return nil, fmt.Errorf("event kind %s is about %s objects, the row about %q", row.Kind, s.Object, row.ObjectType)
	}
	ev := &configv1.Event{Seq: uint64(row.Seq), At: timestamppb.New(row.At), Kind: row.Kind, Security: s.Security(row.Payload)}
	switch s.Op {
	case OpPointer:
		return nil, fmt.Errorf("%s rows are publisher instructions, not events", row.Kind)
	case OpBlock, OpUnblock:
		ev.Change = &configv1.Event_Block{Block: &configv1.BlockChange{
			ObjectType: row.ObjectType, Id: row.ObjectID, Blocked: s.Op == OpBlock,
		}}
		return ev, nil
	}
	o := objects[s.Object]
	r := o.ref(row.ObjectID, row.Payload)
	if s.Op == OpDelete {
		o.deleted(r, ev)
		return ev, nil
	}
	err = o.load(ctx, st, r, now, ev)
	if errors.Is(err, store.ErrNotFound) {
		o.deleted(r, ev)
		return ev, nil
	}
	if err != nil {
		return nil, err
	}
	return ev, nil
}
