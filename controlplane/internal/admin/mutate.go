package admin

import (
	"context"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/events"
	"github.com/sluicegw/sluice/controlplane/internal/store"
)

// mutable describes one object type the Create, Update, Block, Unblock
// and Delete RPCs act on (orgs, teams, users, customers, keys, ...), for
// createObject, updateObject, setBlocked and deleteObject: T is the
// stored object, P its admin API message.
type mutable[T any, P proto.Message] struct {
	object events.Object
	// gate runs before anything is read (nil: none), e.g. an org-level
	// write check and the presence of the id in the request field named
	// field ("id", "customer.id").
	gate func(ctx context.Context, field, id string) error
	// get reads the object in the caller's tenant (Get RPCs), getForUpdate
	// reads and locks it, target is what authz checks (read for get, write
	// for a change) once it is read.
	get          func(st *store.Store, ctx context.Context, t store.Tenant, id string) (T, error)
	getForUpdate func(tx *store.Tx, ctx context.Context, t store.Tenant, id string) (T, error)
	target       func(T) authz.Target
	// lock, when set, replaces getForUpdate and the write check on target:
	// it reads the object for update and checks that the caller may do op
	// to it (events.OpUpsert: update it).
	lock func(ctx context.Context, tx *store.Tx, id string, op events.Op) (T, error)
	// set changes the blocked flag (and cur).
	set func(ctx context.Context, tx *store.Tx, cur *T, blocked bool) error
	// remove deletes the object and returns its deletion event's payload
	// (nil: none).
	remove  func(ctx context.Context, tx *store.Tx, cur T) (any, error)
	toProto func(T) (P, error)
	// scope names the object for its audit record and outbox row: its id,
	// its org and its team ("" when it has none).
	scope func(T) (id, orgID, teamID string)
}

// locked reads the object id of type b for update and checks that the
// caller may do op to it: b.lock, or b.getForUpdate in the caller's tenant
// and a write check on b.target.
func (b mutable[T, P]) locked(ctx context.Context, tx *store.Tx, id string, op events.Op) (T, error) {
	if b.lock != nil {
		return b.lock(ctx, tx, id, op)
	}
	cur, err := b.getForUpdate(tx, ctx, tenant(ctx), id)
	if err != nil {
		return cur, err
	}
	return cur, authz.Check(ctx, principal(ctx), authz.Write, b.target(cur))
}

// getObject reads the object id of type b for a Get RPC: b.get in the
// caller's tenant, then a read check on b.target. The RPC runs its gate
// first.
func getObject[T any, P proto.Message](ctx context.Context, st *store.Store, b mutable[T, P], id string) (P, error) {
	v, err := b.get(st, ctx, tenant(ctx), id)
	if err != nil {
		var none P
		return none, err
	}
	if err := authz.Check(ctx, principal(ctx), authz.Read, b.target(v)); err != nil {
		var none P
		return none, err
	}
	return b.toProto(v)
}

// setBlocked blocks or unblocks the object id of type b in one mutation:
// the change, its audit record (before and after) and its outbox event
// (<object>.blocked or .unblocked, a security event when blocking). It
// returns the object as it is after the change.
func setBlocked[T any, P proto.Message](ctx context.Context, st *store.Store, b mutable[T, P], id string, blocked bool) (P, error) {
	action, op := audit.ActionBlocked, events.OpBlock
	if !blocked {
		action, op = audit.ActionUnblocked, events.OpUnblock
	}
	var out P
	if b.gate != nil {
		if err := b.gate(ctx, "id", id); err != nil {
			return out, err
		}
	}
	err := st.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := b.locked(ctx, tx, id, op)
		if err != nil {
			return err
		}
		before, err := b.toProto(cur)
		if err != nil {
			return err
		}
		if err := b.set(ctx, tx, &cur, blocked); err != nil {
			return err
		}
		if out, err = b.toProto(cur); err != nil {
			return err
		}
		objID, orgID, teamID := b.scope(cur)
		if err := tx.Audit(ctx, action, string(b.object), objID, orgID, teamID, auditJSON(before), auditJSON(out)); err != nil {
			return err
		}
		return outbox(ctx, tx, events.For(b.object, op), orgID, objID, nil)
	})
	return out, err
}

// deleteObject deletes the object id of type b in one mutation: the
// deletion, its audit record (the object before) and its <object>.deleted
// event (a security event).
func deleteObject[T any, P proto.Message](ctx context.Context, st *store.Store, b mutable[T, P], id string) error {
	if b.gate != nil {
		if err := b.gate(ctx, "id", id); err != nil {
			return err
		}
	}
	return st.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := b.locked(ctx, tx, id, events.OpDelete)
		if err != nil {
			return err
		}
		before, err := b.toProto(cur)
		if err != nil {
			return err
		}
		payload, err := b.remove(ctx, tx, cur)
		if err != nil {
			return err
		}
		objID, orgID, teamID := b.scope(cur)
		if err := tx.Audit(ctx, audit.ActionDeleted, string(b.object), objID, orgID, teamID, auditJSON(before), nil); err != nil {
			return err
		}
		return outbox(ctx, tx, events.For(b.object, events.OpDelete), orgID, objID, payload)
	})
}

// createObject inserts cur (through insert, which may do more in the same
// transaction) in one mutation with its audit record (the object after)
// and its <object>.upserted event. It returns the object as created.
func createObject[T any, P proto.Message](ctx context.Context, st *store.Store, b mutable[T, P], cur *T, insert func(tx *store.Tx) error) (P, error) {
	var out P
	err := st.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		if err := insert(tx); err != nil {
			return err
		}
		var err error
		if out, err = b.toProto(*cur); err != nil {
			return err
		}
		objID, orgID, teamID := b.scope(*cur)
		if err := tx.Audit(ctx, audit.ActionCreated, string(b.object), objID, orgID, teamID, nil, auditJSON(out)); err != nil {
			return err
		}
		return outbox(ctx, tx, events.For(b.object, events.OpUpsert), orgID, objID, nil)
	})
	return out, err
}

// updateObject changes the object id of type b in one mutation: it locks
// the object (b.locked with events.OpUpsert), applies the update_mask paths
// of src (out of updatable) to a copy of it, and hands both copies to
// save, which validates the new one and stores it into cur. The audit
// record holds the object before and after, the event is
// <object>.upserted. It returns the object after, with its new
// update_time. The RPC runs b.gate (and any other request check) first.
func updateObject[T any, P proto.Message](ctx context.Context, st *store.Store, b mutable[T, P], id string,
	src P, mask *fieldmaskpb.FieldMask, updatable []string, save func(tx *store.Tx, cur *T, before, after P) error,
) (P, error) {
	var out P
	err := st.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := b.locked(ctx, tx, id, events.OpUpsert)
		if err != nil {
			return err
		}
		before, err := b.toProto(cur)
		if err != nil {
			return err
		}
		after := proto.Clone(before).(P)
		if err := applyMask(after, src, mask, updatable...); err != nil {
			return err
		}
		if err := save(tx, &cur, before, after); err != nil {
			return err
		}
		saved, err := b.toProto(cur)
		if err != nil {
			return err
		}
		copyUpdateTime(after, saved)
		out = after
		objID, orgID, teamID := b.scope(cur)
		if err := tx.Audit(ctx, audit.ActionUpdated, string(b.object), objID, orgID, teamID, auditJSON(before), auditJSON(after)); err != nil {
			return err
		}
		return outbox(ctx, tx, events.For(b.object, events.OpUpsert), orgID, objID, nil)
	})
	return out, err
}

// copyUpdateTime sets the update_time field of dst to that of src (both
// messages of one type that has the field).
func copyUpdateTime(dst, src proto.Message) {
	d := dst.ProtoReflect()
	fd := d.Descriptor().Fields().ByName("update_time")
	d.Set(fd, src.ProtoReflect().Get(fd))
}

// refuseImmutable refuses an update_mask that names one of paths, with
// why the field cannot change.
func refuseImmutable(mask *fieldmaskpb.FieldMask, why string, paths ...string) error {
	for _, p := range mask.GetPaths() {
		for _, im := range paths {
			if p == im {
				return invalid("update_mask", "%s is immutable: %s", p, why)
			}
		}
	}
	return nil
}

// orgObjectGate is the gate of an org-level object (users, customers,
// label scopes, trusted issuers): orgLevelGate for verb on what, then the
// presence of the id in the request field named field.
func orgObjectGate(ctx context.Context, verb authz.Verb, what, field, id string) error {
	if err := orgLevelGate(ctx, verb, what); err != nil {
		return err
	}
	return requireID(field, id)
}

// createTenant resolves and authorises the org of a request creating an
// org-level object (what: "customers"): orgLevelGate, then createOrg, then
// a write check on what of that org.
func createTenant(ctx context.Context, orgID, what string) (string, error) {
	if err := orgLevelGate(ctx, authz.Write, what); err != nil {
		return "", err
	}
	orgID, err := createOrg(ctx, orgID)
	if err != nil {
		return "", err
	}
	return orgID, authz.Check(ctx, principal(ctx), authz.Write, authz.OrgTarget(orgID, what+" of org "+orgID))
}

// page converts one page of rows (of at most limit) and returns it with
// the token of the next page, made from cursor of the last row.
func page[T, P any](rows []T, limit int, toProto func(T) (P, error), cursor func(T) string) ([]P, string, error) {
	var out []P
	for _, r := range rows {
		p, err := toProto(r)
		if err != nil {
			return nil, "", err
		}
		out = append(out, p)
	}
	if len(rows) == 0 {
		return out, "", nil
	}
	return out, nextPageToken(len(rows), limit, cursor(rows[len(rows)-1])), nil
}

// infallible adapts a conversion that cannot fail for page and mutable.
func infallible[T, P any](f func(T) P) func(T) (P, error) {
	return func(t T) (P, error) { return f(t), nil }
}

// reply wraps the response message r of a handler, or returns err.
func reply[R any](r *R, err error) (*connect.Response[R], error) {
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(r), nil
}
