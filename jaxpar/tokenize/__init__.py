"""`jaxpar tokenize`: text, JSON lines and Parquet files made into the token folders that training reads
(jaxpar.data.token_folder), in units that a killed run continues and several hosts share: command.py its
flags and output; input_files.py its inputs as streams; document_readers.py their documents; chat.py chat
templates; work_units.py the work cut into units; unit_encoding.py a unit encoded and written; resumable.py
the hidden folder a rerun continues, and worker processes; assembly.py the folder from its units, and
--merge; folder.py `tokenize`, all of it."""
