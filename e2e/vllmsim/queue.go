package vllmsim

import "container/heap"

// waitingQueue is the scheduler's waiting queue. Under fcfs it is a deque in
// arrival order where preempted sequences go back to the front; under
// priority it is a heap ordered by (priority, arrival, admission order), the
// lowest first, as vLLM's PriorityRequestQueue.
type waitingQueue interface {
	len() int
	peek() *Sequence
	pop() *Sequence
	add(s *Sequence)
	// prepend returns a preempted sequence to the queue.
	prepend(s *Sequence)
	remove(s *Sequence) bool
	// each calls fn for every queued sequence, in no particular order.
	each(fn func(*Sequence))
}

func newWaitingQueue(p Policy) waitingQueue {
	if p == PolicyPriority {
		return &priorityQueue{}
	}
	return &fcfsQueue{}
}

// fcfsQueue is a deque backed by a slice with a moving head.
type fcfsQueue struct {
	items []*Sequence
	head  int
}

func (q *fcfsQueue) len() int { return len(q.items) - q.head }

func (q *fcfsQueue) peek() *Sequence { return q.items[q.head] }

func (q *fcfsQueue) pop() *Sequence {
	s := q.items[q.head]
	q.items[q.head] = nil
	q.head++
	if q.head == len(q.items) {
		q.items, q.head = q.items[:0], 0
	}
	return s
}

func (q *fcfsQueue) add(s *Sequence) { q.items = append(q.items, s) }

func (q *fcfsQueue) prepend(s *Sequence) {
	if q.head > 0 {
		q.head--
		q.items[q.head] = s
		return
	}
	q.items = append(q.items, nil)
	copy(q.items[1:], q.items)
	q.items[0] = s
}

func (q *fcfsQueue) remove(s *Sequence) bool {
	for i := q.head; i < len(q.items); i++ {
		if q.items[i] == s {
			copy(q.items[i:], q.items[i+1:])
			q.items[len(q.items)-1] = nil
			q.items = q.items[:len(q.items)-1]
			if q.head == len(q.items) {
				q.items, q.head = q.items[:0], 0
			}
			return true
		}
	}
	return false
}

func (q *fcfsQueue) each(fn func(*Sequence)) {
	for _, s := range q.items[q.head:] {
		fn(s)
	}
}

// priorityQueue is a binary heap of sequences; Sequence.heapIndex tracks
// each one's position so that aborts remove in O(log n).
type priorityQueue struct{ h seqHeap }

type seqHeap []*Sequence

// Len implements heap.Interface.
func (h seqHeap) Len() int { return len(h) }

// Less implements heap.Interface.
func (h seqHeap) Less(i, j int) bool { return seqLess(h[i], h[j]) }

// seqLess is the waiting order under the priority policy.
func seqLess(a, b *Sequence) bool {
	if a.priority != b.priority {
		return a.priority < b.priority
	}
	if a.arrival != b.arrival {
		return a.arrival < b.arrival
	}
	return a.order < b.order
}

// Swap implements heap.Interface.
func (h seqHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].heapIndex = i
	h[j].heapIndex = j
}

// Push implements heap.Interface.
func (h *seqHeap) Push(x any) {
	s := x.(*Sequence)
	s.heapIndex = len(*h)
	*h = append(*h, s)
}

// Pop implements heap.Interface.
func (h *seqHeap) Pop() any {
	old := *h
	s := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	s.heapIndex = -1
	return s
}

func (q *priorityQueue) len() int            { return q.h.Len() }
func (q *priorityQueue) peek() *Sequence     { return q.h[0] }
func (q *priorityQueue) pop() *Sequence      { return heap.Pop(&q.h).(*Sequence) }
func (q *priorityQueue) add(s *Sequence)     { heap.Push(&q.h, s) }
func (q *priorityQueue) prepend(s *Sequence) { heap.Push(&q.h, s) }
func (q *priorityQueue) remove(s *Sequence) bool {
	i := s.heapIndex
	if i < 0 || i >= len(q.h) || q.h[i] != s {
		return false
	}
	heap.Remove(&q.h, i)
	return true
}
func (q *priorityQueue) each(fn func(*Sequence)) {
	for _, s := range q.h {
		fn(s)
	}
}
