package admin

import (
	"context"

	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/events"
	"github.com/sluicegw/sluice/controlplane/internal/store"
)

// mutable describes one object type the Block, Unblock and Delete RPCs
// act on (orgs, teams, users, customers, keys), for setBlocked and
// deleteObject: T is the stored object, P its admin API message.
type mutable[T any, P proto.Message] struct {
	object events.Object
	// gate runs before anything is read (nil: none), e.g. an org-level
	// write check and the id's presence.
	gate func(ctx context.Context, id string) error
	// lock reads the object for update and checks that the caller may
	// do op to it.
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
		if err := b.gate(ctx, id); err != nil {
			return out, err
		}
	}
	err := st.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := b.lock(ctx, tx, id, op)
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
		if err := b.gate(ctx, id); err != nil {
			return err
		}
	}
	return st.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := b.lock(ctx, tx, id, events.OpDelete)
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
